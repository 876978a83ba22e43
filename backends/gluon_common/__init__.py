"""What the Gluon backends share: Triton-version compatibility, host-side launch planning,
and the Gluon helpers that do not depend on the matrix engine (gating, masks, tails)."""

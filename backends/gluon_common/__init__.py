"""The Gluon pipeline both Gluon backends share, written once: the kernels (:mod:`.wy`,
:mod:`.qk_norm`, :mod:`.state_output` and their engine-independent pieces), their launch
plans and orchestrator, and Triton-version compatibility (:mod:`.compat`). The matrix
engine is not here: each backend package holds its own and hands it to the kernels as
their ``ENGINE`` constexpr (the contract: :mod:`.engine`)."""

"""benchmarks/sass_counts.py's reading of nvdisasm output (no compile): instructions
counted for the function their line info names, loops found by conditional backward
branches only."""

from __future__ import annotations

from pathlib import Path

from gdn_dispatch.testing import script_module

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "sass_counts.py"


def _module():
    return script_module(SCRIPT, "sass_counts_under_test")


def test_instructions_count_for_the_function_of_their_line(tmp_path):
    source = tmp_path / "kern.py"
    source.write_text("def outer():\n    x = 1\n    def inner():\n        return 2\n    return x\n")
    sass = "\n".join([
        f'\t//## File "{source}", line 2',
        "        /*0000*/                   MOV R1, R2 ;",
        f'\t//## File "{source}", line 4',
        "        /*0010*/              @!P0 FADD R3, R4, R5 ;",
        "        /*0020*/                   SHF.R.U32.HI R0, RZ, 0x5, R0 ;",
    ])
    assert _module().attribute(sass) == [(0x0, "kern.py:outer", "MOV"), (0x10, "kern.py:inner", "FADD"),
                                         (0x20, "kern.py:inner", "SHF")]


def test_loops_are_conditional_backward_branches():
    body = "\n".join(f"        /*{a:04x}*/                   NOP ;" for a in range(0x1010, 0x1900, 0x10))
    sass = "\n".join([
        ".L_x_1:", "        /*1000*/                   NOP ;", body,
        "        /*1900*/               @P0 BRA `(.L_x_1) ;",
        "        /*1910*/                   BRA `(.L_x_1) ;",
        "        /*1920*/              @!P1 BRA `(.L_x_2) ;",
        ".L_x_2:", "        /*1930*/                   EXIT ;",
    ])
    module = _module()
    assert module.loops(sass) == [(0x1000, 0x1900)]
    assert module.loops(sass, min_bytes=0x1000) == []

"""The porting page's list of what the drop-ins refuse is complete and true: every ``NotImplementedError`` the compat
modules raise with a message is one of :data:`REFUSALS`, each is raised by the call beside it, and each refused
setting is on the page's list."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

import spikefuse.compat
from spikefuse.compat import norse as cn
from spikefuse.compat import snntorch as cs

PAGE = Path(__file__).parents[2] / "docs" / "porting.md"
COMPAT = Path(spikefuse.compat.__file__).parent


def _mixed_reset():
    lif = cs.Leaky(beta=0.9, reset_mechanism="zero", reset_delay=False)
    lif.reset_mechanism = "subtract"
    lif(torch.rand(2, 3))


def _norse_method():
    norse = pytest.importorskip("norse.torch")
    cn.LIFCell(norse.LIFParameters(method="tanh"))


#: (the setting as the page names it, the start of the error's message, a call that raises it)
REFUSALS = [
    ("inhibition=True", "inhibition=True is not supported", lambda: cs.Leaky(beta=0.9, inhibition=True)),
    ("state_quant", "state_quant is not supported", lambda: cs.Leaky(beta=0.9, state_quant=True)),
    ("reset_mechanism=", "Leaky made with reset_mechanism='zero' and set to 'subtract'", _mixed_reset),
    ("learn_beta=True", "learn_beta=True is not supported", lambda: cs.Lapicque(beta=0.9, learn_beta=True)),
    ("learn_alpha=True", "learn_alpha=True is not supported", lambda: cs.Alpha(0.9, 0.8, learn_alpha=True)),
    ("method=", "Norse's spike function method='tanh'", _norse_method),
    ("record_states=True", "record_states=True is not supported", lambda: cn.LIFCell(record_states=True)),
]


def _raised_messages() -> list[str]:
    """The literal text of every ``raise NotImplementedError(<message>)`` in the compat modules."""
    messages = []
    for path in sorted(COMPAT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                if getattr(node.exc.func, "id", None) == "NotImplementedError":
                    parts = [n.value for n in ast.walk(node.exc.args[0]) if isinstance(n, ast.Constant)]
                    messages.append("".join(str(p) for p in parts))
    return messages


def test_every_refusal_raised_is_listed():
    raised = _raised_messages()
    unlisted = [m for m in raised if not any(setting.split("=")[0] in m for setting, _, _ in REFUSALS)]
    assert not unlisted, f"refusals missing from REFUSALS and the porting page: {unlisted}"
    assert len(raised) == len(REFUSALS), "a refusal listed that the code no longer raises, or raised twice"


@pytest.mark.parametrize("setting, message, call", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_each_refusal_is_raised_and_on_the_page(setting, message, call):
    with pytest.raises(NotImplementedError, match=re.escape(message)):
        call()
    section = PAGE.read_text().split("## What the drop-ins refuse", 1)[1]
    assert f"`{setting}" in section

"""The exit codes are one table (ctl/exitcodes.py); README.md and docs/protocol.md carry
it rendered, and every protocol error has its exit code."""

import os
import re

from colibri.ctl import exitcodes
from colibri.daemon import protocol as P

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rendered(doc: str) -> str:
    text = open(os.path.join(ROOT, doc)).read()
    m = re.search(r"<!-- exit codes: .*? -->\n(.*?)\n<!-- end exit codes -->", text, re.S)
    assert m, f"{doc} has no exit-code block"
    return m.group(1)


def test_the_docs_carry_the_one_table():
    assert rendered("README.md") == exitcodes.markdown()
    assert rendered("docs/protocol.md") == exitcodes.protocol_markdown()


def test_every_protocol_error_has_an_exit_code_and_every_code_a_meaning():
    assert set(exitcodes.FROM_ERROR) == set(P.ERRORS)
    assert set(exitcodes.FROM_ERROR.values()) <= set(exitcodes.MEANING)
    codes = [v for k, v in vars(exitcodes).items() if k.isupper() and isinstance(v, int)]
    assert sorted(set(codes)) == sorted(exitcodes.MEANING) and len(codes) == len(set(codes))

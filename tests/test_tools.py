"""Tools as plain Python functions (``arbor.data.tools``): schemas from a user's tools file (equal to
transformers' ``get_json_schema``), clear errors for functions that cannot be tools, and ``call_tool``'s
observations for a result, an unknown tool, bad arguments, an exception and a timeout."""

import asyncio

import pytest
from transformers.utils import get_json_schema

from arbor.data.tools import call_tool, load_tools, tool_from_function
from arbor.models.tool_calls import ToolCall

TOOLS_FILE = '''
import asyncio
import time
from typing import Literal, Optional


def search(query: str, limit: int, tags: list[str], site: Optional[str] = None,
           order: Literal["new", "top"] = "top", exact: bool = False) -> list[dict]:
    """Search the web for pages.

    Longer notes that are not part of the first paragraph's meaning.

    Args:
        query: What to look for,
            over two lines.
        limit: How many results at most.
        tags: Tags the pages must carry.
        site: Only pages of this site.
        order: How to sort the results.
        exact (bool): Match the query exactly.

    Returns:
        The pages found.
    """
    return [{"query": query, "limit": limit}]


def calc(expr: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expr: The expression, e.g. 2+2.
    """
    if "/0" in expr:
        raise ZeroDivisionError("division by zero in " + expr)
    return str(eval(expr, {"__builtins__": {}}))


def nap(seconds: float) -> str:
    """Sleep a while.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


async def fetch(url: str) -> dict:
    """Fetch a page.

    Args:
        url: The page's address.
    """
    await asyncio.sleep(0.01 if url != "slow" else 5)
    return {"url": url, "bytes": {1, 2}} if url == "odd" else {"url": url, "status": 200}
'''

SEARCH_SCHEMA = {"type": "function", "function": {
    "name": "search",
    "description": "Search the web for pages.\n\nLonger notes that are not part of the first paragraph's meaning.",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "description": "What to look for, over two lines."},
        "limit": {"type": "integer", "description": "How many results at most."},
        "tags": {"type": "array", "items": {"type": "string"}, "description": "Tags the pages must carry."},
        "site": {"type": "string", "nullable": True, "description": "Only pages of this site."},
        "order": {"type": "string", "enum": ["new", "top"], "description": "How to sort the results."},
        "exact": {"type": "boolean", "description": "Match the query exactly."},
    }, "required": ["query", "limit", "tags"]}}}


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "my_tools.py"
    path.write_text(TOOLS_FILE)
    return {t.name: t for t in load_tools([f"{path}:{n}" for n in ("search", "calc", "nap", "fetch")])}


def test_schema_from_signature_and_docstring(tools):
    assert tools["search"].schema == SEARCH_SCHEMA
    theirs = get_json_schema(tools["search"].fn)
    theirs["function"].pop("return")
    assert tools["search"].schema == theirs          # the same convention as transformers
    assert tools["fetch"].schema["function"]["parameters"] == {
        "type": "object", "properties": {"url": {"type": "string", "description": "The page's address."}},
        "required": ["url"]}


def test_more_types():
    def f(a: dict, b: dict[str, int], c: int | None, d: int | str, e: list, g: float = 1.0):
        """F.

        Args:
            a: A.
            b: B.
            c: C.
            d: D.
            e: E.
            g: G (choices: [1.0, 2.5])
        """
    props = tool_from_function(f).schema["function"]["parameters"]["properties"]
    assert props == {"a": {"type": "object", "description": "A."},
                     "b": {"type": "object", "additionalProperties": {"type": "integer"}, "description": "B."},
                     "c": {"type": "integer", "nullable": True, "description": "C."},
                     "d": {"type": ["integer", "string"], "description": "D."},
                     "e": {"type": "array", "description": "E."},
                     "g": {"type": "number", "enum": [1.0, 2.5], "description": "G"}}
    assert tool_from_function(f).schema == get_json_schema(f)


class Point:
    pass


def no_doc(x: int):
    return x


def untyped(x):
    """Untyped.

    Args:
        x: X.
    """


def custom(p: Point):
    """Custom.

    Args:
        p: A point.
    """


def star(*xs: int):
    """Star.

    Args:
        xs: Numbers.
    """


def undescribed(x: int, y: int):
    """Half described.

    Args:
        x: X.
    """


@pytest.mark.parametrize("fn, message", [
    (no_doc, "tool no_doc: no docstring; write one whose first paragraph"),
    (untyped, "tool untyped: parameter 'x' has no type hint (accepted: str, int, float, bool, list[X]"),
    (custom, "tool custom: parameter 'p' has the type 'Point', which has no JSON schema (accepted: str, int"),
    (star, "tool star: *xs cannot be described to a model; accepted: named parameters"),
    (undescribed, "tool undescribed: parameter 'y' is not described in the docstring's 'Args:' section"),
])
def test_functions_that_cannot_be_tools(fn, message):
    with pytest.raises(ValueError) as e:
        tool_from_function(fn)
    assert str(e.value).startswith(message), str(e.value)


def test_load_errors(tmp_path):
    path = tmp_path / "t.py"
    path.write_text(TOOLS_FILE + "\nalias = calc\n")
    with pytest.raises(ValueError, match=r"tools: two tools are named 'calc' \(.*:calc and .*:alias\)"):
        load_tools([f"{path}:calc", f"{path}:alias"])
    with pytest.raises(ValueError, match="env.tools: .* has no 'missing'"):
        load_tools([f"{path}:missing"], what="env.tools")
    with pytest.raises(ValueError, match="expected a list"):
        load_tools(f"{path}:calc")


def run(tools, name, timeout_s=10.0, **arguments):
    return asyncio.run(call_tool(tools, ToolCall(name, arguments), timeout_s))


def test_call_tool_results(tools):
    assert run(tools, "calc", expr="2+2") == "4"
    assert run(tools, "search", query="q", limit=2, tags=[]) == '[{"query": "q", "limit": 2}]'
    assert run(tools, "fetch", url="a") == '{"url": "a", "status": 200}'
    assert run(tools, "fetch", url="odd") == "{'url': 'odd', 'bytes': {1, 2}}"     # not JSON: str()


def test_call_tool_never_raises(tools):
    assert run(tools, "foo") == "error: unknown tool 'foo'; available: calc, fetch, nap, search"
    assert run(tools, "calc") == ("error: calc: bad arguments (missing a required argument: 'expr'); "
                                  "expected calc(expr: str) -> str")
    assert run(tools, "calc", expr="1", extra=2).startswith(
        "error: calc: bad arguments (got an unexpected keyword argument 'extra')")
    assert run(tools, "calc", expr="1/0") == "error: calc raised ZeroDivisionError: division by zero in 1/0"
    assert run(tools, "nap", timeout_s=0.05, seconds=0.5) == "error: nap did not finish within 0.05 s"
    assert run(tools, "fetch", timeout_s=0.05, url="slow") == "error: fetch did not finish within 0.05 s"
    bad = asyncio.run(call_tool(tools, ToolCall("calc", ["2+2"])))
    assert bad == "error: calc: arguments must be a JSON object, got list"
    assert all("\n" not in run(tools, n) for n in ("foo", "calc"))

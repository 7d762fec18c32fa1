"""The calculator the model may call: a plain typed function with a Google-style docstring.

Arbor builds the tool's schema from the signature and the docstring (as transformers'
``get_json_schema`` does), so this file needs no Arbor import: ``tools=["tools.py:calc"]``.
The name and the argument are short on purpose: a character-level model writes every call out
as ``<tool_call>{"name":"calc","arguments":{"expr":"8*7"}}</tool_call>``.
"""

import ast
import operator

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calc(expr: str) -> str:
    """Evaluate an integer expression.

    Args:
        expr: integers with + - * and parentheses, e.g. 8*7-14
    """
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only integers, + - * and parentheses")

    if len(expr) > 100:
        return "error: expression too long"
    try:
        return str(value(ast.parse(expr, mode="eval").body))
    except (SyntaxError, ValueError) as e:
        return f"error: {e.msg if isinstance(e, SyntaxError) else e}"

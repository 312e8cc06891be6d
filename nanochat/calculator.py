"""
The calculator tool: what the model may run between <|python_start|> and <|python_end|> (the engine forces its
answer into the sample between <|output_start|> and <|output_end|>). Numbers with + - * / // % ** and parentheses,
unary minus, and 'literal'.count('literal'), parsed with `ast` and walked by a whitelist: nothing is ever eval'd, and
every operation is bounded (characters, digits, exponent, time), so a hostile expression costs at most a tenth of a
second. Code the model writes in general runs in the sandbox instead (nanochat/execution.py).
"""

import ast
import math
import operator
import time


CALCULATOR_MAX_CHARS = 1000  # longer expressions are refused before parsing
CALCULATOR_MAX_EXPONENT = 100
CALCULATOR_MAX_DIGITS = 1000  # no integer (intermediate or final) may have more digits
CALCULATOR_SECONDS = 0.1

_BINARY_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
               ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


class _Refused(Exception):
    pass


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _checked(value):
    """Refuse results that are not plain finite numbers or that grew past the digit cap."""
    if not _is_number(value) or (isinstance(value, float) and not math.isfinite(value)) or \
            (isinstance(value, int) and value.bit_length() > CALCULATOR_MAX_DIGITS * math.log2(10)):
        raise _Refused
    return value


def _evaluate(node, deadline):
    """Walk a whitelisted expression tree; anything not named here is refused. Every operation is bounded by the
    digit and exponent caps, so checking the clock between operations bounds the whole evaluation."""
    if time.monotonic() > deadline:
        raise _Refused
    if isinstance(node, ast.Constant) and _is_number(node.value):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _evaluate(node.operand, deadline)
        return _checked(-operand if isinstance(node.op, ast.USub) else +operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _evaluate(node.left, deadline), _evaluate(node.right, deadline)
        if isinstance(node.op, ast.Pow):
            if abs(right) > CALCULATOR_MAX_EXPONENT:
                raise _Refused
            # predict the size of an integer power instead of computing a huge one and then refusing it
            if isinstance(left, int) and right > 0 and right * left.bit_length() > CALCULATOR_MAX_DIGITS * math.log2(10) + 64:
                raise _Refused
        return _checked(_BINARY_OPS[type(node.op)](left, right))
    is_count_call = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "count"
                     and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str)
                     and len(node.args) == 1 and not node.keywords
                     and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str))
    if is_count_call:
        return node.func.value.value.count(node.args[0].value)
    raise _Refused


def use_calculator(expr):
    """
    The result of a calculator expression as text, or None when it is not one we evaluate: numbers with
    + - * / // % ** and parentheses, unary minus, and 'literal'.count('literal'). Parsed with `ast` and walked by a
    whitelist: nothing is ever eval'd.
    """
    if not isinstance(expr, str) or len(expr) > CALCULATOR_MAX_CHARS:
        return None
    try:
        value = _evaluate(ast.parse(expr.strip(), mode="eval").body, time.monotonic() + CALCULATOR_SECONDS)
    except (_Refused, SyntaxError, ValueError, TypeError, ArithmeticError, RecursionError, MemoryError):
        return None
    if isinstance(value, float):
        value = float(f"{value:.12g}")  # hide binary noise such as 0.1 + 0.2 = 0.30000000000000004
        if value.is_integer():
            return str(int(value))
    return str(value)

"""Chat templates compiled and rendered under a budget: a runaway template fails its own render.

transformers renders chat templates in jinja2's ImmutableSandboxedEnvironment, which keeps a
template away from Python's internals but not from running long: `range()` stops at 100,000
items, yet two nested loops over it are 10^10 steps, and a template may nest loops over the
client's messages as deep as it likes. A render that never ends holds its HTTP thread and its
tokenizer copy (server.api.tokenizer_pool) until every copy is held and nothing else tokenizes.
So the server renders with its own environment, the same sandbox with the same globals and
filters as transformers' (`raise_exception`, `tojson`, `strftime_now`, `dict`, `namespace`, the
`generation` tag, loop controls), plus a budget per render (`RenderBudget`):

- steps: each iteration of every `{% for %}` loop (the loop's iterable is wrapped when the
  template compiles, `_Metered`), each call (macros, methods, globals, a recursive loop's
  `loop(...)`, whose iterable is wrapped too), filter, intercepted operator and output chunk is
  one step; past `MAX_STEPS` the render stops. Counting loop iterations, not only calls, is what
  catches a loop whose body calls nothing (`{% for b in range(100000) %}x{% endfor %}`).
- time: every step checks a deadline, `MAX_RENDER_S` after the render began, for steps that are
  each costly (a filter over a long list), so a render ends in bounded time whatever it does.
- size: no value a call, filter, `~`, `+`, `*` or `%` makes, nor a namespace attribute, nor the
  output, may pass `max_chars` (the longest prompt the server could take: a longer one cannot fit
  anyway), and integer arguments past it (`'x'.ljust(10**12)`, `tojson(indent=...)`) and
  integers past `MAX_INT_BITS` are refused before the operation runs: one C-level operation
  cannot be interrupted by a step count, so its operands are bounded instead.

Steps and sizes are deterministic (the same template fails the same way on any machine); the
deadline is the backstop. Pure-Python rendering lets other threads run between bytecodes, so
requests beside a runaway render keep being served while it spends its budget. A render past
its budget raises `RenderBudgetError` (a jinja2 TemplateError: the chat path's 400).
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Iterable, Iterator
from contextlib import closing
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

MAX_STEPS = 1_000_000  # real templates take hundreds to a few thousand steps a conversation
MAX_RENDER_S = 2.0  # wall time of one render
MAX_INT_BITS = 4096  # `**` and `*` on integers: no template needs a larger number
DEFAULT_MAX_CHARS = 1 << 24  # where the caller knows no prompt bound
_SIZED = (str, bytes, list, tuple, dict, set, frozenset)
_METER = "_toppings_meter"  # the filter a loop's iterable passes through
_SIZE = "_toppings_size"  # the filter a `~` concatenation passes through
_FORMAT_FIELD = re.compile(r"%[#0 +\-]*[\d*]*(?:\.[\d*]+)?|\{[^{}]*\}")  # %-specs and {}-fields

_BUDGET: ContextVar[RenderBudget | None] = ContextVar("chat_template_budget", default=None)


class RenderBudgetError(jinja2.TemplateError):
    """A chat template passed its render budget (steps, time or size)."""


class RenderBudget:
    """What one render may still spend; `step()` is called by every metered operation."""

    def __init__(self, max_chars: int, max_steps: int = MAX_STEPS, max_s: float = MAX_RENDER_S):
        self.max_chars = max_chars
        self.max_steps = max_steps
        self.num_steps = 0
        self.num_output_chars = 0
        self._deadline = time.monotonic() + max_s
        self._max_s = max_s

    def step(self) -> None:
        self.num_steps += 1
        if self.num_steps > self.max_steps:
            raise RenderBudgetError(f"the chat template ran past {self.max_steps} steps")
        if time.monotonic() > self._deadline:
            raise RenderBudgetError(f"the chat template ran past {self._max_s:g} s")

    def check_size(self, value: Any) -> Any:
        """`value`, unless it is a string or collection over `max_chars` long."""
        if isinstance(value, _SIZED) and len(value) > self.max_chars:
            raise RenderBudgetError(
                f"the chat template made a value of {len(value)} items or characters, over "
                f"the {self.max_chars} this server's longest prompt has"
            )
        return value

    def check_operands(self, args: Iterable[Any]) -> None:
        """Refuse integers that would make a value past the bound before anything is made."""
        for arg in args:
            if isinstance(arg, int) and not isinstance(arg, bool):
                if abs(arg) > self.max_chars:
                    raise RenderBudgetError(f"the chat template used the number {arg}, over "
                                            f"this server's bound of {self.max_chars}")  # fmt: skip

    def check_format(self, text: str) -> None:
        """Refuse a format string whose field widths or precisions pass the bound, or come
        from the arguments (`%*d`)."""
        for field in _FORMAT_FIELD.findall(text):
            if field.startswith("%") and "*" in field:
                raise RenderBudgetError("the chat template formats with a width from its data")
            for digits in re.findall(r"\d+", field):
                if len(digits) > 9 or int(digits) > self.max_chars:
                    raise RenderBudgetError(f"the chat template formats with width {digits[:12]}"
                                            f", over this server's bound")  # fmt: skip

    def add_output(self, text: str) -> None:
        self.step()
        self.num_output_chars += len(text)
        if self.num_output_chars > self.max_chars:
            raise RenderBudgetError(
                f"the chat template's output passed {self.max_chars} characters, the longest "
                "prompt this server takes"
            )


def _budget() -> RenderBudget:
    budget = _BUDGET.get()
    if budget is None:  # compiling folds constants through filters: leave those to the render
        raise RenderBudgetError("a chat template is rendered only under a budget")
    return budget


def _metered(iterable: Iterable[Any]) -> Iterator[Any]:
    budget = _budget()
    for item in iterable:
        budget.step()
        yield item


@jinja2.pass_context  # never folded at compile time: it needs the render's budget
def _meter_filter(context: Any, iterable: Iterable[Any]) -> Iterator[Any]:
    return _metered(iterable)


@jinja2.pass_context
def _size_filter(context: Any, value: Any) -> Any:
    budget = _budget()
    budget.step()
    return budget.check_size(value)


class _Metered(NodeTransformer):
    """Every `{% for %}` iterable through the step meter, every `~` through the size check."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, _METER, [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        self.generic_visit(node)
        return nodes.Filter(node, _SIZE, [], [], None, None, lineno=node.lineno)


def _bounded_filter(func: Any) -> Any:
    """`func` (a jinja filter) as one step, its integer arguments (not the value it filters:
    `{{ n|string }}` of a large n makes nothing large) and its result bounded."""
    num_leading = 2 if getattr(func, "jinja_pass_arg", None) else 1  # context, then the value

    @functools.wraps(func)  # keeps jinja's pass_context/pass_environment mark
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.step()
        budget.check_operands((*args[num_leading:], *kwargs.values()))
        return budget.check_size(func(*args, **kwargs))

    return bounded


class _GenerationTag(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (marks the assistant's tokens for
    training masks): rendered as its body, which is all serving needs."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _TemplateDict:
    """transformers' `dict` global: a constructor without the type's attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(Namespace):
    """transformers' `namespace`: no underscore names; here also no value past the bound."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's signature, `self` included
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name, value in attrs.items():
            _check_attribute(name, value)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_attribute(name, value)
        Namespace.__setitem__(self, name, value)


def _check_attribute(name: Any, value: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a namespace cannot hold {name!r}")
    _budget().check_size(value)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _int_bits(value: Any) -> int:
    return abs(value).bit_length() if isinstance(value, int) else 0


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat template environment, with every loop, call, filter and operator that
    can make work or memory metered by the current render's `RenderBudget`."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=[_GenerationTag, loopcontrols])  # fmt: skip
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(f) for name, f in self.filters.items()}
        self.filters[_METER] = _meter_filter
        self.filters[_SIZE] = _size_filter
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                            dict=_TemplateDict(), namespace=_TemplateNamespace)  # fmt: skip

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        return _Metered().visit(super()._parse(source, name, filename))

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.step()
        method = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
        owner = getattr(method, "__self__", None)
        if isinstance(owner, (str, bytes)):  # ljust, center, zfill, expandtabs, format: sizes
            budget.check_operands((*args, *kwargs.values()))
            if getattr(method, "__name__", "").startswith("format"):
                budget.check_format(owner)
        if isinstance(obj, LoopContext) and args:  # a recursive loop's next level
            args = (_metered(args[0]), *args[1:])
        return budget.check_size(super().call(context, obj, *args, **kwargs))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.step()
        if operator == "**" and _int_bits(left) > 1 and isinstance(right, int):
            if _int_bits(left) * right > MAX_INT_BITS:
                raise RenderBudgetError(f"the chat template raised a number to the power {right}")
        elif operator == "*":
            if isinstance(left, int) and isinstance(right, int):
                if _int_bits(left) + _int_bits(right) > MAX_INT_BITS:
                    raise RenderBudgetError("the chat template multiplied numbers too large")
            else:  # a sequence repeated: its length times the count, before it is made
                count = right if isinstance(right, int) else left
                seq = left if isinstance(right, int) else right
                if isinstance(count, int) and isinstance(seq, _SIZED):
                    budget.check_operands([len(seq) * count])
        elif operator == "%" and isinstance(left, str):
            budget.check_format(left)
        return budget.check_size(super().call_binop(context, operator, left, right))


@functools.lru_cache(maxsize=1)
def sandbox() -> BudgetedSandbox:
    """The one environment every chat template compiles in."""
    return BudgetedSandbox()


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """`source` compiled (cached: a server renders one or two templates); raises
    jinja2.TemplateSyntaxError for a malformed one."""
    return sandbox().from_string(source)


def render_template(source: str, context: dict[str, Any], max_chars: int | None = None) -> str:
    """`source` rendered with `context` under a fresh `RenderBudget` whose size bound is
    `max_chars` (None: DEFAULT_MAX_CHARS); raises RenderBudgetError past the budget and what
    jinja raises for a template error."""
    template = compile_template(source)
    budget = RenderBudget(max_chars or DEFAULT_MAX_CHARS)
    token = _BUDGET.set(budget)
    try:
        pieces = []
        with closing(template.generate(context)) as chunks:
            for chunk in chunks:
                budget.add_output(chunk)
                pieces.append(chunk)
        return "".join(pieces)
    finally:
        _BUDGET.reset(token)

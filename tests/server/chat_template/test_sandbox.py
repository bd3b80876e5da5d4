"""Chat templates render under a budget (server.chat_template.sandbox, server.chat_template.render):
an ordinary template renders exactly as transformers' apply_chat_template does, and a runaway one
(nested loops, loops over the client's messages, doubling strings, giant widths or powers) stops
with RenderBudgetError instead of running on."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from toppings.server.chat_template.render import render_chat
from toppings.server.chat_template.sandbox import MAX_STEPS, RenderBudgetError, render_template
from toppings.server.requests.request import RequestError

CHATML = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if tools %}{{ tools|tojson(indent=2) }}{% endif %}"
    "{% for m in messages %}{% generation %}{{ loop.index }}{% endgeneration %}{% endfor %}"
    "{% set ns = namespace(n=0) %}{% for m in messages if m.role == 'user' %}"
    "{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CONTEXT = {"messages": [{"role": "user", "content": "x"}] * 40, "add_generation_prompt": True}
NESTED = "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}"


def tokenizer(template: str) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["<s>", "<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", unk_token="[UNK]")
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_an_ordinary_template_renders_as_transformers_renders_it(tools):
    tok = tokenizer(CHATML)
    ours = render_chat(tok, MESSAGES, tools)
    theirs = tok.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=True,
                                     tokenize=False)  # fmt: skip
    assert ours == theirs and ours.startswith("<s><|im_start|>system")
    assert ours.endswith("121<|im_start|>assistant\n")  # loop indices, then one user message


@pytest.mark.parametrize(
    "template",
    [
        NESTED,
        NESTED.replace("x", ""),  # a loop that calls and writes nothing
        "{% for a in messages %}{% for b in messages %}{% for c in messages %}"
        "{% for d in messages %}{% for e in messages %}{% endfor %}{% endfor %}{% endfor %}"
        "{% endfor %}{% endfor %}",  # the client's messages, nested: 40^5 steps
        "{% macro d(s) %}{{ d(s ~ s) }}{% endmacro %}{{ d('x') }}",
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}",
        "{% for a in range(100000) recursive %}{% if loop.depth == 1 %}{{ loop(range(100000)) }}"
        "{% endif %}{% endfor %}",  # the second level's iterations call nothing
        "{{ 'x'.ljust(10**12) }}",
        "{{ 'x'|center(1000000000) }}",
        "{{ 'x' * 1000000000 }}",
        "{{ 9 ** (9 ** 9) }}",
        "{{ '%1000000000d' % 1 }}",
        "{{ '{:>1000000000}'.format(1) }}",
    ],
    ids=["nested range", "silent loops", "nested messages", "doubling macro", "doubling namespace",
         "recursive loop", "ljust", "center", "repeat", "power", "percent width", "format width"],
)  # fmt: skip
def test_a_runaway_template_stops_at_its_budget(template):
    with pytest.raises(RenderBudgetError, match="the chat template"):
        render_template(template, CONTEXT, max_chars=100_000)


def test_the_step_budget_is_per_render():
    loop = "{% for a in range(1000) %}{% for b in range(" + str(MAX_STEPS // 2000) + ") %}"
    loop += "{% endfor %}{% endfor %}ok"  # MAX_STEPS / 2 and a little
    for _ in range(3):  # together past the budget, each within it
        assert render_template(loop, CONTEXT) == "ok"


@pytest.mark.parametrize(
    "template, words",
    [
        (NESTED, "ran past"),
        ("{{ raise_exception('only user turns, please') }}", "only user turns, please"),
        ("{{ ''.__class__.__mro__ }}", "unsafe"),
    ],
)
def test_render_chat_turns_every_template_failure_into_a_400(template, words):
    with pytest.raises(RequestError, match="chat template rejected the messages") as info:
        render_chat(tokenizer(template), MESSAGES)
    assert info.value.code == 400 and words in str(info.value)

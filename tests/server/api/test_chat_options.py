"""vLLM's chat render fields (server.api.openai.chat_options): `add_generation_prompt`,
`continue_final_message` and `chat_template_kwargs` give the prompt that transformers'
`apply_chat_template` gives with the same arguments (the oracle), on /tokenize and on the chat
route (whose greedy tokens are those of /v1/completions on the oracle's ids); what they cannot
mean is a 400 naming the field, and the scheduler does not guess ids for such a body."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from toppings.scheduler.prompt_tokens import PromptCounter
from toppings.server.api.app import create_app
from toppings.server.api.openai.schema import parse_chat
from toppings.server.api.options import ApiOptions
from toppings.server.chat_template.render import cut_after_final

# Qwen3's switch, in the shape its template has it: an empty thought when thinking is off.
THINKING = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"
)
ASKED = [{"role": "user", "content": "name a colour"}]
STARTED = [*ASKED, {"role": "assistant", "content": "The colour is"}]


@pytest.fixture(scope="module")
def served(tiny_engine, tiny_model_dir, tmp_path_factory):
    """(client of the checkpoint's template, client of THINKING, the oracle tokenizer)."""
    with tiny_engine({}, max_total_tokens=1024) as engine:
        own = create_app(engine).test_client()
        thinking = create_app(engine, ApiOptions(chat_template=THINKING)).test_client()
        yield own, thinking, AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _oracle(tokenizer, template: str | None, messages, **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         **kwargs)  # fmt: skip
    return list(tokenizer.encode(text, add_special_tokens=False))


def _tokens(client, body: dict) -> list[int]:
    answer = client.post("/tokenize", json=body)
    assert answer.status_code == 200, answer.get_data()[:300]
    return answer.get_json()["tokens"]


@pytest.mark.parametrize(
    "fields, oracle",
    [
        ({}, {"add_generation_prompt": True}),
        ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
        ({"chat_template_kwargs": {"enable_thinking": False}},
         {"add_generation_prompt": True, "enable_thinking": False}),
        ({"chat_template_kwargs": {"enable_thinking": True}},
         {"add_generation_prompt": True, "enable_thinking": True}),
    ],
    ids=["default", "no generation prompt", "thinking off", "thinking on"],
)  # fmt: skip
def test_tokenize_renders_as_apply_chat_template(served, fields, oracle):
    own, thinking, tokenizer = served
    assert _tokens(thinking, {"messages": ASKED, **fields}) == _oracle(
        tokenizer, THINKING, ASKED, **oracle
    )
    if "chat_template_kwargs" not in fields:
        assert _tokens(own, {"messages": ASKED, **fields}) == _oracle(
            tokenizer, None, ASKED, **oracle
        )


@pytest.mark.parametrize("final", ["The colour is", "The colour is ", "  The colour is\n"])
def test_a_continued_message_ends_the_prompt_as_apply_chat_template_ends_it(served, final):
    own, thinking, tokenizer = served
    messages = [*ASKED, {"role": "assistant", "content": final}]
    for client, template in ((own, None), (thinking, THINKING)):
        ids = _tokens(client, {"messages": messages, "continue_final_message": True})
        expected = _oracle(tokenizer, template, messages, continue_final_message=True,
                           add_generation_prompt=False)  # fmt: skip
        assert ids == expected
        text = tokenizer.decode(ids)
        assert text.rstrip().endswith("The colour is") and "<|im_end|>" not in text[-20:]


def test_the_chat_route_generates_from_the_rendered_prompt(served):
    own, thinking, tokenizer = served
    for client, template, fields, oracle in [
        (own, None, {"continue_final_message": True},
         {"continue_final_message": True, "add_generation_prompt": False}),
        (thinking, THINKING, {"chat_template_kwargs": {"enable_thinking": False}},
         {"add_generation_prompt": True, "enable_thinking": False}),
    ]:  # fmt: skip
        greedy = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
        chat = client.post("/v1/chat/completions", json={"messages": STARTED if template is None
                           else ASKED, **fields, **greedy})  # fmt: skip
        assert chat.status_code == 200, chat.get_data()[:300]
        ids = _oracle(tokenizer, template, STARTED if template is None else ASKED, **oracle)
        plain = client.post("/v1/completions", json={"prompt": ids, **greedy}).get_json()
        assert chat.get_json()["usage"]["prompt_tokens"] == len(ids)
        assert chat.get_json()["choices"][0]["message"]["content"] == plain["choices"][0]["text"]


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"continue_final_message": True, "add_generation_prompt": True}, "cannot both be true"),
        ({"continue_final_message": "yes"}, "'continue_final_message' must be a boolean"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "must be an object, not array"),
        ({"chat_template_kwargs": {f"k{i}": 1 for i in range(33)}}, "at most 32 keys"),
        ({"chat_template_kwargs": {"messages": []}}, "cannot set 'messages'"),
        ({"chat_template_kwargs": {"eos_token": "x"}}, "cannot set 'eos_token'"),
        ({"chat_template_kwargs": {"raise_exception": 1}}, "cannot set 'raise_exception'"),
    ],
    ids=["both", "not a boolean", "not an object", "too many", "messages", "a special token",
         "a global"],
)  # fmt: skip
def test_what_cannot_be_meant_is_a_400_naming_the_field(served, fields, words):
    own, _, _ = served
    for path in ("/v1/chat/completions", "/tokenize"):
        answer = own.post(path, json={"messages": STARTED, "max_tokens": 2, **fields})
        assert answer.status_code == 400, (path, answer.get_data()[:300])
        assert words in answer.get_json()["error"]["message"], answer.get_json()


def test_a_final_message_without_text_cannot_be_continued(served):
    own, _, _ = served
    messages = [*ASKED, {"role": "assistant", "content": " "}]
    answer = own.post("/v1/chat/completions", json={"messages": messages,
                                                    "continue_final_message": True})  # fmt: skip
    assert answer.status_code == 400
    assert "needs text in the final message" in answer.get_json()["error"]["message"]


def test_the_parse_and_the_cut():
    parsed = parse_chat({"messages": STARTED, "continue_final_message": True}, "m")
    assert parsed.chat.continue_final_message and not parsed.chat.add_generation_prompt
    assert parse_chat({"messages": ASKED}, "m").chat.add_generation_prompt
    # a template that kept the trailing space: kept; one that trimmed it: cut at the text
    assert cut_after_final("<a>hi there <e><a>", "hi there ") == "<a>hi there "
    assert cut_after_final("<a>hi there<e><a>", "hi there ") == "<a>hi there"
    with pytest.raises(Exception, match="does not render the final message"):
        cut_after_final("<a>HI THERE<e>", "hi there")


def test_the_scheduler_guesses_no_ids_for_a_body_that_sets_them(tiny_model_dir):
    counter = PromptCounter(str(tiny_model_dir))
    assert counter.token_ids({"messages": ASKED}, "chat") is not None
    for field, value in (("add_generation_prompt", False), ("continue_final_message", True),
                         ("chat_template_kwargs", {"enable_thinking": False})):  # fmt: skip
        assert counter.token_ids({"messages": ASKED, field: value}, "chat") is None

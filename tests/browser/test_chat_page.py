"""A chat model's prompt box takes a conversation (issue 19): the "Chat" toggle shows only for a
model whose checkpoint has a chat template (GET /models lists `chat`), the turns typed as
`role: text` lines are rendered by the server with the model's template, and the attention
views and a generation show exactly the tokens transformers' apply_chat_template gives."""

from __future__ import annotations

import urllib.parse

import pytest
from live_server import live_server

from .helpers import rendered, screenshot, state, wait_rendered

transformers = pytest.importorskip("transformers")

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is Romeo?"}]
TYPED = "system: Be brief.\nuser: Who is Romeo?"


@pytest.fixture(scope="module")
def chat_server(tiny_checkpoint, chat_checkpoint, tmp_path_factory):
    """The tiny decoder (the default, no template) and the imported Llama 3 "llama3-chat"."""
    env = {"ATTNLENS_MODELS": f"{tiny_checkpoint},{chat_checkpoint[1]}", "OMP_NUM_THREADS": "1"}
    with live_server(tiny_checkpoint, tmp_path_factory.mktemp("browser-chat-logs"), env=env) as srv:
        yield srv


def template_ids(chat_checkpoint, messages) -> list[int]:
    auto = transformers.AutoTokenizer.from_pretrained(chat_checkpoint[0])
    return list(auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"])


def open_chat(page, server, **query):
    q = {"model": "llama3-chat", "prompt": TYPED, "chat": "1", **query}
    page.goto(f"{server.base_url}/?{urllib.parse.urlencode(q)}")
    return wait_rendered(page)


def analysed_ids(page) -> list[int]:
    return state(page, "s.att.tokens.map(t => t.id)")


def test_the_chat_toggle_shows_only_for_a_model_with_a_template(page, chat_server):
    page.goto(f"{chat_server.base_url}/?prompt=To+be")
    wait_rendered(page)
    assert not page.is_visible("#chat")
    r = rendered(page)
    page.select_option("#model-picker", "llama3-chat")
    wait_rendered(page, r)
    assert page.is_visible("#chat") and not page.is_checked("#chat")


def test_a_conversation_is_analysed_as_the_template_renders_it(page, chat_server, chat_checkpoint):
    open_chat(page, chat_server)
    assert page.is_checked("#chat")
    want = template_ids(chat_checkpoint, CONVERSATION)
    assert analysed_ids(page) == want
    assert page.console_log.errors == []
    screenshot(page, "chat-conversation.png")


def test_turning_chat_on_makes_the_text_the_users_turn(page, chat_server, chat_checkpoint):
    page.goto(f"{chat_server.base_url}/?model=llama3-chat&prompt=Who+is+Romeo%3F")
    r = wait_rendered(page)
    plain = analysed_ids(page)
    page.check("#chat")
    wait_rendered(page, r)
    assert page.input_value("#prompt") == "user: Who is Romeo?"
    want = template_ids(chat_checkpoint, [{"role": "user", "content": "Who is Romeo?"}])
    assert analysed_ids(page) == want and want != plain
    assert "chat=1" in page.url or state(page, "s.chat")


def test_generate_sends_the_conversation_and_analyses_the_rendered_tokens(page, chat_server, chat_checkpoint):
    open_chat(page, chat_server, max_new_tokens="4", temperature="0")
    bodies = []
    page.on("request", lambda req: bodies.append(req.post_data_json) if req.url.endswith("/generate") else None)
    r = rendered(page)
    page.click("#generate")
    page.wait_for_function("() => !window.__attnlens.store.state.streaming && window.__attnlens.store.state.ids")
    wait_rendered(page, r)
    (body,) = bodies
    assert body["messages"] == CONVERSATION and "prompt" not in body
    want = template_ids(chat_checkpoint, CONVERSATION)
    ids, plen = state(page, "s.ids"), state(page, "s.plen")
    assert plen == len(want) and ids[:plen] == want and len(ids) > plen
    assert analysed_ids(page) == ids  # the views read the template's tokens and the generated ones


def test_a_line_without_a_role_is_named(page, chat_server):
    open_chat(page, chat_server)
    page.fill("#prompt", "Who is Romeo?\nuser: hi")
    page.click("#analyse")
    page.wait_for_selector("#messages :text('beginning with its role')")

"""app/serving/prompts.py (render_chat) renders a chat template exactly as transformers' apply_chat_template does."""

from __future__ import annotations

import pytest

from attnlens.app.serving.prompts import ChatTemplateError, render_chat

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Llama-2's: a system message folded into the first user turn, raise_exception on bad order, bos_token
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
          "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
          "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
          "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if loop.index0 == 0 and system_message != false %}"
          "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
          "{% else %}{% set content = message['content'] %}{% endif %}"
          "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
          "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
          "{% endfor %}")
# trim_blocks / lstrip_blocks, namespace(), tojson and loop controls, as real templates use them
FANCY = """{% set ns = namespace(n=0) %}
{% for m in messages %}
  {% if m.role == 'system' %}{% continue %}{% endif %}
  {% set ns.n = ns.n + 1 %}
  {{ ns.n }}:{{ m.role }}={{ m.content | tojson }}
{% endfor %}
{% if add_generation_prompt %}assistant:{% endif %}"""

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is Romeo? <b>é</b>"},
                {"role": "assistant", "content": "A Montague."}, {"role": "user", "content": "And Juliet?"}]


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_checkpoint):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(tiny_checkpoint / "tokenizer.json"), bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("template", [CHATML, LLAMA2, FANCY], ids=["chatml", "llama2", "fancy"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers_does(hf_tokenizer, template, add_generation_prompt):
    want = hf_tokenizer.apply_chat_template(CONVERSATION, chat_template=template, tokenize=False,
                                            add_generation_prompt=add_generation_prompt)
    got = render_chat(template, CONVERSATION, dict(hf_tokenizer.special_tokens_map),
                      add_generation_prompt=add_generation_prompt)
    assert got == want and got


def test_a_template_that_refuses_the_conversation_says_why():
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat(LLAMA2, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                    {"bos_token": "<s>", "eos_token": "</s>"})


def test_a_template_cannot_reach_python_internals():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        render_chat(evil, CONVERSATION, {})
    with pytest.raises(ChatTemplateError):
        render_chat("{% set ns = namespace(_x=1) %}", CONVERSATION, {})


def test_a_template_that_does_not_compile_is_named():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat("{% for m in messages %}", CONVERSATION, {})

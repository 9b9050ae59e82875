"""A tiny random-weight Llama with its own locally trained tokenizer, for vLLM on any machine.

Nothing is downloaded: the byte-level BPE tokenizer is trained with `tokenizers` on a built-in
corpus and the weights are drawn from a fixed seed, so the tests, the benchmarks and
`ops/run.sh --cluster ops/clusters/vllm-cpu.toml` serve the same model everywhere. head_dim is
64 (vLLM's CPU attention refuses head_dim 16).

    python -m hetmesh.engines.vllm_tiny DIR      # writes config, weights, tokenizer into DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VOCAB = 1024
EOS = "</s>"
BOS = "<s>"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

_WORDS = ("the mesh serves models on mixed accelerators prefill decode cache block token worker scheduler "
          "gateway transfer latency throughput batch request stream prompt hello world quick brown fox jumps "
          "over lazy dog one two three four five six seven eight nine ten red green blue system user assistant")


def _corpus() -> list[str]:
    words = _WORDS.split()
    lines = []
    for i in range(2000):  # deterministic word salad: enough merges for a 1024-entry vocab
        lines.append(" ".join(words[(i * 7 + j * 13) % len(words)] for j in range(12)) + f" {i}.")
    return lines


def build(out: str | Path, *, hidden: int = 256, layers: int = 2, heads: int = 4, kv_heads: int = 2,
          max_positions: int = 2048, seed: int = 0) -> Path:
    """Write a HF model folder (config.json, safetensors weights, tokenizer.json) and return its path."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_positions, bos_token_id=tok.token_to_id(BOS),
                      eos_token_id=tok.token_to_id(EOS), tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the default init: greedy text that varies with the prompt
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    (out / "hetmesh-tiny.json").write_text(json.dumps({"seed": seed, "hidden": hidden, "layers": layers}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m hetmesh.engines.vllm_tiny", description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(build(args.out, seed=args.seed))


if __name__ == "__main__":
    main()

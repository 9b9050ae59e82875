"""vLLM alone, no Hetmesh code: greedy completions of fixed token prompts with vLLM's own `LLM`.

Run as a script (vLLM starts its engine core by spawn, hence the main guard):
    python tests/vllm/reference.py MODEL_DIR PROMPTS.json OUT.json MAX_TOKENS
"""

import json
import os
import sys

if __name__ == "__main__":
    model, prompts_path, out_path, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads(open(prompts_path).read())
    llm = LLM(model=model, dtype="float32", max_model_len=1024, enforce_eager=True, block_size=128,
              enable_prefix_caching=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    with open(out_path, "w") as f:
        json.dump([{"token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text} for o in outs], f)

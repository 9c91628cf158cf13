"""One vLLM instance serving greedy requests read from stdin, run by conftest.Instance in a
process of its own: a line of JSON in ({"tokens", "max_tokens", "kv_transfer_params"}), a
line "RESULT <json>" out ({"tokens", "logprobs", "finish_reason", "kv_transfer_params",
"seconds"}; "logprobs": each chosen token's).

    python instance.py MODEL CONFIG_JSON

CONFIG_JSON: LLM keyword arguments added to (or replacing) the defaults below (e.g.
kv_transfer_config, block_size)."""
from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model, extra = sys.argv[1], json.loads(sys.argv[2])
    args = dict(model=model, enforce_eager=True, block_size=32, max_model_len=2048, dtype="float32",
                gpu_memory_utilization=0.5, seed=0, distributed_executor_backend="uni")
    llm = LLM(**dict(args, **extra))
    print("READY", flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=ask["max_tokens"], ignore_eos=True, logprobs=0,
                                extra_args={"kv_transfer_params": ask.get("kv_transfer_params")})
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ask["tokens"])], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        first = out.outputs[0]
        logprobs = [step[t].logprob for step, t in zip(first.logprobs or (), first.token_ids)]
        print("RESULT " + json.dumps(dict(tokens=list(first.token_ids), logprobs=logprobs,
                                          finish_reason=first.finish_reason,
                                          kv_transfer_params=out.kv_transfer_params, seconds=seconds)),
              flush=True)


if __name__ == "__main__":
    main()

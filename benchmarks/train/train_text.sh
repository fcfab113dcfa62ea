# Sourced by the device scripts: the training text they share, built once per machine into $TEXT
# ($DATA/train: essays + Shakespeare, plus every other top-level module of the Python standard library),
# the mixed text's split into training and held-out folders (split_text), the step that turns a linearize
# run into a package-style asset folder, and the OVQ fine-tune's variants as `longctx finetune` options.
TEXT=${TEXT:-/tmp/train-text}
STDLIB=${STDLIB:-$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')}

# build_train_text [force]: builds $TEXT from $DATA/train unless it exists (force: rebuild it)
build_train_text() {
  if [ "${1:-}" = force ]; then rm -rf "$TEXT"; fi
  if [ ! -d "$TEXT" ]; then
    mkdir -p "$TEXT/stdlib"
    cp -r "$DATA"/train/* "$TEXT"/
    ls "$STDLIB"/*.py | awk 'NR % 2 == 0' | xargs -I{} cp {} "$TEXT/stdlib/"
  fi
  du -sh "$TEXT"/*
}

# write_run_asset RUN DESCRIPTION: the trained weights of the linearize run in RUN (a `longctx finetune` output)
# as an asset folder, RUN/assets/smollm2-135m-instruct-lolcats, so that LONGCTX_ASSET_PATH=RUN/assets makes
# checkpoint=auto load exactly these weights. Needs $MODEL.
write_run_asset() {
  python3 - "$MODEL" "$1" "$2" <<'PY'
import sys
from longctx_patch.assets import write_asset
from longctx_patch.provenance import git_commit
from longctx_patch.models import load_model_only
model = load_model_only(sys.argv[1], device="cpu")
out = write_asset(sys.argv[2], model, sys.argv[2] + "/assets/smollm2-135m-instruct-lolcats",
                  name="smollm2-135m-instruct-lolcats", description=sys.argv[3],
                  extra={"commit": git_commit(), "recipe": "recipes/linearize.yaml"})
print("asset:", out)
PY
}

# split_text: the mixed text from the raw text in $SRC (pg_essays/, books/tinyshakespeare.txt) into $W/train
# (text/, code/) and $W/heldout-{code,book,essays}, once per machine. The split (deterministic): every 5th essay
# and the book's last 10% held out; the standard library's non-test modules alternate between training and
# held-out in sorted order. Essays and the book are repeated 3x in the
# training text so that natural language is a large share of it (2.84M tokens in all with SmolLM2's tokenizer).
split_text() {
  [ -d "$W/train" ] && return 0
  mkdir -p "$W/train/text" "$W/train/code" "$W/heldout-code" "$W/heldout-book" "$W/heldout-essays"
  python3 - "$SRC" "$W" <<'PY'
import pathlib, shutil, sys, sysconfig
src, w = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
essays = sorted(p for p in (src / "pg_essays").glob("*.txt") if "LICENSE" not in p.name)
for i, p in enumerate(essays):
    if i % 5 == 4:
        shutil.copy(p, w / "heldout-essays" / p.name)
    else:
        for r in range(3):
            shutil.copy(p, w / "train" / "text" / f"{r}-{p.name}")
book = (src / "books" / "tinyshakespeare.txt").read_text()
cut = book.rfind("\n\n", 0, int(len(book) * 0.9))
for r in range(3):
    (w / "train" / "text" / f"{r}-tinyshakespeare.txt").write_text(book[:cut])
(w / "heldout-book" / "tinyshakespeare-last10.txt").write_text(book[cut:])
lib = pathlib.Path(sysconfig.get_paths()["stdlib"])
skip = ("test", "tests", "site-packages", "idlelib", "lib2to3", "__pycache__")
mods = sorted(p for p in lib.rglob("*.py") if not any(s in p.relative_to(lib).parts for s in skip))
for i, p in enumerate(mods):
    name = str(p.relative_to(lib)).replace("/", "__")
    if i % 2 == 0:
        shutil.copy(p, w / "train" / "code" / name)
    else:  # `longctx eval ppl` reads a folder's .txt files
        shutil.copy(p, w / "heldout-code" / (name + ".txt"))
print(f"essays {len(essays)}, modules {len(mods)}")
PY
  du -sh "$W"/*/ "$W"/train/*
}

# The OVQ paper's hybrid (OVQ on the even layers, a 256-token sliding window on the others), as options of
# `longctx finetune recipes/ovq-finetune.yaml`; OVQ_HYBRID_LAYERS: the OVQ layers (default SmolLM2's 30 layers' even
# ones; Qwen2.5-Coder-0.5B's 24: [0,2,...,22]).
OVQ_HYBRID=(--set "layers=${OVQ_HYBRID_LAYERS:-[0,2,4,6,8,10,12,14,16,18,20,22,24,26,28]}" --set rest_method=sliding-window
            --set 'rest_config={window: 256}')

# lora_only_stage [RECIPE]: the option that keeps only RECIPE's finetune stage, training its LoRA alone (the
# references of a method's fine-tune: the same stage on the unpatched or another model); benchmarks.shared has the rule.
lora_only_stage() {
  python3 -c 'import sys; from benchmarks.shared import lora_stage_only as f; print(f(sys.argv[1]))' \
    "${1:-recipes/ovq-finetune.yaml}"
}

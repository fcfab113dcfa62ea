# Sourced by the device scripts: the training text they share, built once per machine into $TEXT
# ($DATA/train: essays + Shakespeare, plus every other top-level module of the Python standard library),
# and the step that turns a linearize run into a package-style asset folder.
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
from longctx_patch.evals.common import git_commit
from longctx_patch.models import load_model_only
model = load_model_only(sys.argv[1], device="cpu")
out = write_asset(sys.argv[2], model, sys.argv[2] + "/assets/smollm2-135m-instruct-lolcats",
                  name="smollm2-135m-instruct-lolcats", description=sys.argv[3],
                  extra={"commit": git_commit(), "recipe": "recipes/linearize.yaml"})
print("asset:", out)
PY
}

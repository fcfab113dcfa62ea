# Sourced by the device scripts: the training text they share, built once per machine into $TEXT
# ($DATA/train: essays + Shakespeare, plus every other top-level module of the Python standard library).
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

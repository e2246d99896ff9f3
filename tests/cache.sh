# Sourced by tests/*/build.sh, each of which builds a tool from the Go module proxy once per
# machine into a cache folder keyed by its versions and inputs.
#
#   cache_at NAME KEY [FILE]   sets $root (GPUSLICE_<NAME>_CACHE, else ~/.cache/gpuslice/<name>)
#                              and $dest ($root/KEY, or $root/KEY/FILE for a single binary)
#   done_or_find MODE CHECK…   when the command CHECK… succeeds, prints $dest and exits 0; else,
#                              with MODE --find (the script's $1), says what is missing and exits 1
#   go_release OUT PACKAGE     a static, stripped build of PACKAGE (run from the module's folder)

cache_at() {
  local override="GPUSLICE_${1^^}_CACHE"
  root="${!override:-$HOME/.cache/gpuslice/$1}"
  dest="$root/$2${3:+/$3}"
}

done_or_find() {
  local mode="$1"
  shift
  if "$@"; then
    echo "$dest"
    exit 0
  fi
  if [[ "$mode" == "--find" ]]; then
    echo "not built yet (expected at $dest)" >&2
    exit 1
  fi
}

go_release() {
  local out="$1" package="$2"
  shift 2
  CGO_ENABLED=0 GOFLAGS=-mod=readonly go build -trimpath -ldflags "-s -w $*" -o "$out" "$package"
}

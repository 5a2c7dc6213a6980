#!/usr/bin/env bash
# Makes this machine ready to build and test dtrain. Idempotent: skips what is there.
#   - Debian packages: Open MPI, gflags, glog, GoogleTest, ninja, ccache, nlohmann-json, protobuf,
#     SentencePiece, zlib and zstd (dtrain-prepare)
#   - .venv/ inside the repository with PyTorch 2.11.x (CUDA 13 wheel: libtorch, its CMake
#     config and the NCCL wheel torch loads), plus the Python packages tests compare against.
# Environment: DTRAIN_TORCH_VERSION (default 2.11.*), DTRAIN_SKIP_APT=1 to skip apt.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
say() { echo "[setup] $*"; }
die() { echo "[setup] ERROR: $*" >&2; exit 1; }

APT_PACKAGES=(
  openmpi-bin libopenmpi-dev libgflags-dev libgoogle-glog-dev libgtest-dev libgmock-dev
  ninja-build ccache nlohmann-json3-dev protobuf-compiler libprotobuf-dev pkg-config zlib1g-dev
  libsentencepiece-dev libzstd-dev
)

if [[ "${DTRAIN_SKIP_APT:-0}" != 1 ]]; then
  missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    SUDO=""
    if [[ $(id -u) != 0 ]]; then
      command -v sudo >/dev/null || die "need root (or sudo) to install: ${missing[*]}"
      SUDO=sudo
    fi
    say "installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq || die "apt-get update failed; check the network or the apt sources"
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
      || die "apt-get install failed for: ${missing[*]}"
  else
    say "Debian packages present"
  fi
fi

PY="${DTRAIN_PYTHON:-python3}"
command -v "$PY" >/dev/null || die "python3 not found; install python3 (>= 3.10) first"
TORCH_SPEC="${DTRAIN_TORCH_VERSION:-2.11.*}"
if [[ ! -x .venv/bin/python ]]; then
  say "creating virtual environment .venv/"
  "$PY" -m venv .venv || die "python3 -m venv failed; install python3-venv"
fi
VPY="$ROOT/.venv/bin/python"
# Free space is checked before pip starts: torch's CUDA wheels need about 5 GiB installed plus
# their unpacked copies under TMPDIR while installing, and a disk that fills up half way leaves a
# broken .venv and an error from pip that does not say what to do.
need_gib() {  # need_gib DIR GiB WHAT
  local free_kib
  free_kib=$(df -Pk "$1" 2>/dev/null | awk 'NR==2 {print $4}')
  [[ -z $free_kib ]] && return 0
  ((free_kib >= $2 * 1024 * 1024)) && return 0
  die "only $((free_kib / 1024 / 1024)) GiB free on the filesystem of $1; $3 needs about $2 GiB. Free some space (old clones of this repository with their .venv/ and build/, ~/.cache/pip), or set TMPDIR to a larger filesystem for pip's temporary files"
}
if ! "$VPY" -c "import torch,sys; sys.exit(0 if torch.__version__.startswith('${TORCH_SPEC%\*}'.rstrip('.')) else 1)" 2>/dev/null; then
  need_gib "$ROOT" 8 "installing torch into .venv"
  [[ $(df -P "${TMPDIR:-/tmp}" | awk 'NR==2 {print $1}') == $(df -P "$ROOT" | awk 'NR==2 {print $1}') ]] \
    || need_gib "${TMPDIR:-/tmp}" 4 "unpacking torch's wheels (TMPDIR)"
  say "installing torch==${TORCH_SPEC} into .venv (CUDA 13 wheel; a few GB, takes minutes)"
  "$VPY" -m pip install -q --upgrade pip >/dev/null
  if ! "$VPY" -m pip install -q "torch==${TORCH_SPEC}"; then
    say "torch==${TORCH_SPEC} could not be installed; trying the nearest newer release"
    "$VPY" -m pip install -q "torch>2.11,<3" || die "no torch wheel could be installed from PyPI"
  fi
else
  say "torch $("$VPY" -c 'import torch;print(torch.__version__)') present in .venv"
fi
# Python packages used by tests and docs as independent references/readers.
PY_EXTRAS=(numpy tensorboard scikit-learn safetensors transformers sentencepiece tiktoken matplotlib zstandard)
for m in "${PY_EXTRAS[@]}"; do
  mod="$m"; [[ $m == scikit-learn ]] && mod=sklearn
  "$VPY" -c "import $mod" 2>/dev/null || { say "installing $m into .venv"; "$VPY" -m pip install -q "$m" || die "pip install $m failed"; }
done
"$VPY" - <<'PYEOF' || die "torch in .venv is unusable"
import torch, os
import importlib.util
spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
print(f"[setup] torch {torch.__version__} (cuda {torch.version.cuda}), cmake prefix {torch.utils.cmake_prefix_path}")
if spec:
    print(f"[setup] nccl wheel at {list(spec.submodule_search_locations)[0]}")
PYEOF
say "done"

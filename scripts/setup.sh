# Sourced by run_training.sh and run_tests.sh: `setup_python ROOT REQUIREMENTS...` sets
# PYTHON to an interpreter that has every requirement, installing only what is missing.
#
# 1. An interpreter that already has everything (python3, or $PYTHON) is used as it is:
#    nothing is installed and the network is not touched.
# 2. Otherwise ROOT/.venv is created with --system-site-packages, so a torch that the
#    machine already has (GPU machines usually do) is reused, never replaced.
# 3. torch, when missing, is installed within the bounds of requirements.txt's torch line
#    (the one place they are written), a CPU build on machines without an NVIDIA GPU: pip's
#    default torch for Linux pulls several GB of CUDA packages.
# 4. An importable torch below the floor is reported, never replaced; one above the upper
#    bound is used with a warning line (GPU machines come with the torch their driver runs).
# 5. An AMD Instinct GPU machine (KFD's topology, or rocminfo, shows an MI200, MI300 or MI350 class
#    GPU) without torch is told how to install ROCm's torch, and nothing is installed: a CPU or
#    CUDA build would not use its GPUs. Its installed torch is reused like any other (one warning
#    line when it is not a ROCm build), and AMD SMI's Python bindings come from ROCm
#    ($ROCM_PATH/share/amd_smi), never from PyPI. Another AMD GPU that ROCm drives (an APU, a Radeon
#    workstation card: /dev/kfd is there too) gets one warning line and the CPU build, as before.
# Later runs find everything in place and start in about a second.

_setup_log() { echo "setup: $*" >&2; }

# What Python and the dynamic loader say when the address space runs out (ulimit -v).
_NO_MEMORY='failed to map segment|MemoryError|Cannot allocate memory|can.t start new thread|Memory allocation'

_probe() {  # COMMAND...: run it quietly; 3 (the line said) when it failed for want of address space
  local out rc=0
  out=$("$@" 2>&1 >/dev/null) || rc=$?
  if [ "$rc" -ne 0 ] && [ "$(ulimit -v)" != unlimited ] && grep -qE "$_NO_MEMORY" <<<"$out"; then
    # Else a Python that cannot start reads as too old, and a requirement check that cannot run as
    # missing packages, which setup would then try to install.
    _setup_log "error: not enough address space to start Python: ulimit -v is $(ulimit -v) KiB; raise it (ulimit -v unlimited)"
    return 3
  fi
  return "$rc"
}

_has_nvidia_gpu() {
  [ -e /proc/driver/nvidia/version ] || { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
}

_has_amd_gpu() {  # any GPU ROCm drives: its compute driver interface, or rocminfo reaching it
  [ -e /dev/kfd ] || { command -v rocminfo >/dev/null 2>&1 && rocminfo >/dev/null 2>&1; }
}

# KFD's topology, one directory per agent; tests point it at a scripted one.
_KFD_NODES=${SETUP_KFD_NODES:-/sys/class/kfd/kfd/topology/nodes}

_has_instinct_gpu() {  # an AMD Instinct GPU the launcher trains on: gfx90a (MI200), gfx94x (MI300), gfx950 (MI350)
  # gfx_target_version is major*10000 + minor*100 + stepping: 90010 is gfx90a, 904xx gfx94x,
  # 905xx gfx950. Other gfx9 values are older GPUs or APUs (gfx90c: 90012), gfx10+ Radeon.
  if cat "$_KFD_NODES"/*/properties 2>/dev/null |
    awk '$1 == "gfx_target_version" && ($2 == 90010 || ($2 >= 90400 && $2 < 100000)) { found = 1 } END { exit !found }'; then
    return 0
  fi
  command -v rocminfo >/dev/null 2>&1 && rocminfo 2>/dev/null | grep -qE 'AMD Instinct|gfx90a|gfx94[0-9]|gfx950'
}

_rocm_root() { echo "${ROCM_PATH:-/opt/rocm}"; }

_rocm_torch_index() {  # pytorch.org's index for this machine's ROCm release (X.Y from ROCm's version file)
  local version
  version=$(grep -oE '^[0-9]+\.[0-9]+' "$(_rocm_root)/.info/version" 2>/dev/null | head -n 1)
  echo "https://download.pytorch.org/whl/rocm${version:-X.Y}"
}

_rocm_notes() {  # PY FILES...: on an AMD GPU machine, one line for a torch that is not ROCm's, one for AMD SMI's bindings
  local py=$1; shift
  _has_instinct_gpu || return 0
  # torch/version.py, read rather than imported (importing torch costs seconds on every start):
  # ROCm's builds set hip to the HIP version, CPU and CUDA builds to None.
  if "$py" - <<'PY' 2>/dev/null; then
import importlib.util, pathlib, re, sys
spec = importlib.util.find_spec("torch")
text = pathlib.Path(spec.submodule_search_locations[0], "version.py").read_text()
sys.exit(0 if re.search(r"^hip\b[^=]*=\s*None", text, re.M) else 1)
PY
    _setup_log "warning: this machine has an AMD GPU but the installed torch $("$py" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null) is not a ROCm build, so training cannot use the GPU; install ROCm's: $py -m pip install --force-reinstall '$(_torch_spec "$@")' --index-url $(_rocm_torch_index)"
  fi
  local bindings
  bindings="$(_rocm_root)/share/amd_smi"
  if [ -d "$bindings" ] && ! "$py" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("amdsmi") is None)' 2>/dev/null; then
    _setup_log "note: ROCm's AMD SMI Python bindings are not importable by $py, so the launcher reads the GPUs through the amd-smi command instead; to use them (AMD's instructions, never PyPI's amdsmi): $py -m pip install $bindings (as root, or from a copy of that directory)"
  fi
  return 0
}

_CPU_INDEX=https://download.pytorch.org/whl/cpu

_cpu_index_reachable() {  # PY; urllib honours HTTPS_PROXY like pip does
  "$1" - "$_CPU_INDEX/" <<'PY' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(urllib.request.Request(sys.argv[1], method="HEAD"), timeout=5)
PY
}

_install_cpu_torch() {  # PY SPEC
  local py=$1 spec=$2
  local pip=("$py" -m pip install --quiet --disable-pip-version-check --progress-bar off)
  # The CPU index holds CPU-only wheels, and pip prefers 2.x+cpu over PyPI's 2.x with CUDA.
  # Where that index cannot be reached (a mirror-only network), the configured indexes are
  # used alone; probing first avoids pip's retries on every package. The cap is a release
  # known to have a CPU wheel on the indexes this setup meets.
  local extra=()
  _cpu_index_reachable "$py" && extra=(--extra-index-url "$_CPU_INDEX")
  _setup_log "installing $spec (CPU build: no NVIDIA GPU found)"
  # torch alone first: a CUDA build names nvidia-* packages among its requirements, and
  # those several GB must not be downloaded onto a machine without a GPU.
  "${pip[@]}" --no-deps "${extra[@]}" "$spec" || return 1
  if "$py" -c 'import importlib.metadata as m, sys; sys.exit(any(r.startswith("nvidia") for r in m.requires("torch") or []))'; then
    "${pip[@]}" "${extra[@]}" "$spec" || return 1  # its remaining (CPU) dependencies
  else
    "$py" -m pip uninstall --quiet --yes torch >/dev/null 2>&1
    _setup_log "error: no CPU build of torch is reachable (only a CUDA build, with GB of CUDA packages); install a CPU torch into $(dirname "$(dirname "$py")") yourself, or set TORCH_SPEC"
    return 1
  fi
}

_has_requirements() {  # PY ROOT FILES...: 0 when PY has them all, 3 when it cannot start (_probe)
  local py=$1 root=$2; shift 2
  _probe "$py" "$root/scripts/check_requirements.py" "$@"
}

_torch_spec() {  # FILES...: the first torch line of the requirement files, without its comment
  local spec
  spec=$(grep -hoE '^torch([<>=!~][^#[:space:]]*)?' "$@" 2>/dev/null | head -n 1)
  echo "${spec:-torch}"
}

_use_python() {  # PY ROOT FILES...: the chosen interpreter, warning once per package above its upper bound
  local py=$1 root=$2 line; shift 2
  PYTHON=$py
  # Above the bound is used anyway: a GPU machine's torch matches its driver, and replacing it
  # could pull a CUDA build the driver cannot run. The warning says what was tested.
  while IFS= read -r line; do
    [ -n "$line" ] && _setup_log "warning: $line"
  done < <("$py" "$root/scripts/check_requirements.py" --newer "$@" 2>/dev/null)
  _rocm_notes "$py" "$@"
}

setup_python() {
  local root=$1; shift
  local base=${PYTHON:-python3}
  if ! command -v "$base" >/dev/null 2>&1; then
    _setup_log "error: $base not found; install Python 3.10 or newer, or set PYTHON=/path/to/python3"
    return 1
  fi
  local found=0  # exit 2 where the address space is too small, as the launcher's own refusal
  _probe "$base" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || found=$?
  [ "$found" -ne 3 ] || return 2
  if [ "$found" -ne 0 ]; then
    _setup_log "error: Python 3.10 or newer is needed, $base is $("$base" --version 2>&1); set PYTHON=/path/to/python3"
    return 1
  fi
  _has_requirements "$base" "$root" "$@" || found=$?
  [ "$found" -ne 3 ] || return 2
  if [ "$found" -eq 0 ]; then _use_python "$base" "$root" "$@"; return 0; fi

  local venv=$root/.venv
  if [ -x "$venv/bin/python" ]; then
    found=0
    _has_requirements "$venv/bin/python" "$root" "$@" || found=$?
    [ "$found" -ne 3 ] || return 2
    if [ "$found" -eq 0 ]; then _use_python "$venv/bin/python" "$root" "$@"; return 0; fi
  fi
  _setup_log "installing what is missing into $venv (once; later runs reuse it)"
  if [ ! -x "$venv/bin/python" ]; then
    "$base" -m venv --system-site-packages "$venv" || { _setup_log "error: cannot create $venv"; return 1; }
  fi
  local py=$venv/bin/python
  local pip=("$py" -m pip install --quiet --disable-pip-version-check --progress-bar off)
  local missing required torch_spec
  required=$(_torch_spec "$@")
  torch_spec=${TORCH_SPEC:-$required}  # what gets installed; the floor is always the requirement's
  missing=$("$py" "$root/scripts/check_requirements.py" "$@") || true  # exits 1 when any is missing
  if "$py" -c 'import torch' >/dev/null 2>&1; then
    if grep -qE '^torch([<>=!~ ]|$)' <<<"$missing"; then  # importable but too old: never replaced
      _setup_log "error: the installed torch $("$py" -c 'import torch; print(torch.__version__)') is older than $(sed -nE 's/.*>=[[:space:]]*([0-9][0-9.]*).*/\1/p' <<<"$required"), the oldest this code runs on; upgrade it (pip install '$required'), or set PYTHON=/path/to/another/python3"
      return 1
    fi
  elif _has_instinct_gpu && ! _has_nvidia_gpu; then
    # ROCm's torch comes from pytorch.org's ROCm index, matched to the installed ROCm: a guess
    # would download GB, and pip's default (CUDA) or a CPU build would leave the GPUs unused.
    _setup_log "error: no torch here, and this machine has an AMD GPU (ROCm): install ROCm's build of torch, e.g. $py -m pip install '$torch_spec' --index-url $(_rocm_torch_index) (pytorch.org lists the ROCm releases each torch is built for), or set PYTHON=/path/to/a/python3 that has it; a CPU or CUDA build would not use the GPU"
    return 1
  elif _has_nvidia_gpu; then
    # Bounded like the CPU build: an unbounded spec takes the newest CUDA build, which may need
    # a newer driver than the machine has.
    _setup_log "installing $torch_spec (NVIDIA GPU found)"
    "${pip[@]}" "$torch_spec" || return 1
    if ! "$py" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' >/dev/null 2>&1; then
      _setup_log "warning: the installed torch $("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null) cannot use this machine's GPU (a CUDA build newer than the driver?); reinstall the build for your driver (nvidia-smi shows its CUDA version), e.g. $py -m pip install --force-reinstall '$torch_spec' --index-url https://download.pytorch.org/whl/cu126"
    fi
  else
    if _has_amd_gpu; then
      _setup_log "warning: this machine's AMD GPU is not an Instinct GPU (MI200, MI300, MI350 class) that the launcher trains on, so the CPU build of torch is installed; for ROCm's build: $py -m pip install '$torch_spec' --index-url $(_rocm_torch_index)"
    fi
    _install_cpu_torch "$py" "$torch_spec" || return 1
  fi
  missing=$("$py" "$root/scripts/check_requirements.py" "$@") || true
  if [ -n "$missing" ]; then
    _setup_log "installing $(echo $missing)"
    # Only the missing ones, so an installed torch is never upgraded or replaced.
    echo "$missing" | xargs -d '\n' "${pip[@]}" || return 1
  fi
  _has_requirements "$py" "$root" "$@" || { _setup_log "error: requirements still missing after install"; return 1; }
  _use_python "$py" "$root" "$@"
}

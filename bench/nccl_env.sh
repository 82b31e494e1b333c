# Sourced by the data-parallel scripts: NCCL from pip's wheel (or wherever the system has it)
# linked under the name lemo loads it by (`libnccl.so`) in "$WORK/nccl", put on
# LD_LIBRARY_PATH, with NVLink multicast off. Needs PYTHON and WORK.
export NCCL_NVLS_ENABLE=0
NCCL_SO=$("$PYTHON" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
[ -f "$NCCL_SO" ] || NCCL_SO=$(find / -name 'libnccl.so.2*' -not -path '/proc/*' 2>/dev/null | head -1)
mkdir -p "$WORK/nccl" && ln -sf "$NCCL_SO" "$WORK/nccl/libnccl.so"
export LD_LIBRARY_PATH="$WORK/nccl:${LD_LIBRARY_PATH:-}"
echo "NCCL: $NCCL_SO" >&2

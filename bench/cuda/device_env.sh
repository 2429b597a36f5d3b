# Sourced at the start of a device run (bench/cuda/pack_for_device.sh made .devbin/bins.tar.xz
# here; the run carries .devbin): unpacks the binaries to $B and finds cuBLAS, the CUDA runtime
# and NCCL in the image's PyTorch packages. Defines C80, the prompt benchmark's configuration
# (the 80B-A3B cut to 6 layers, random weights, batch 1).
set -uo pipefail
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
for d in /opt/torch/.venv/lib/python3*/site-packages/nvidia/{cu13,nccl}/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$d"
done
B=/tmp/bins
mkdir -p $B && tar xJf .devbin/bins.tar.xz -C $B
export LD_LIBRARY_PATH="$B/lib:$LD_LIBRARY_PATH"
# The test binaries find the models and references under the source directory they were built in.
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
C80="--config configs/qwen3-next-80b-a3b-instruct.json --random-weights --layers 6 --device cuda --batch 1 --prompt-len 2048"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader

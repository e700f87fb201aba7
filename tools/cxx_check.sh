#!/usr/bin/env bash
# Compiles csrc/ files without a GPU machine, to find C++ and CUDA errors before spending device
# time: each file to a thrown-away object, against the installed torch's headers (a CPU build of
# torch will do) and a CUDA 13.0 toolkit made of NVIDIA's pip wheels, installed once into
# $GRAPHQUANT_CUDA_KIT (default ~/.cache/graphquant/cuda13). A .cpp takes about a minute.
#   bash tools/cxx_check.sh csrc/cuda/register.cpp [csrc/cuda/tile_bf16.cu ...]
set -uo pipefail
KIT=${GRAPHQUANT_CUDA_KIT:-$HOME/.cache/graphquant/cuda13}
CU=$KIT/nvidia/cu13
if [ ! -x "$CU/bin/nvcc" ]; then
  python3 -m pip install -q --no-deps --target "$KIT" "nvidia-cuda-nvcc>=13.0,<13.1" "nvidia-cuda-crt>=13.0,<13.1" \
    "nvidia-nvvm>=13.0,<13.1" "nvidia-cuda-runtime>=13.0,<13.1" "nvidia-cuda-cccl>=13.0,<13.1" "nvidia-cublas>=13.0,<13.2" \
    nvidia-cusparse nvidia-cusolver nvidia-curand || exit 2
fi
# A CPU build of torch lacks this generated header of its CUDA build; its content is one define.
mkdir -p "$KIT/torch_cuda/c10/cuda/impl"
echo "#define C10_CUDA_BUILD_SHARED_LIBS" > "$KIT/torch_cuda/c10/cuda/impl/cuda_cmake_macros.h"
INCLUDES=$(python3 -c "from torch.utils import cpp_extension as c; import sysconfig; print(' '.join('-I' + p for p in c.include_paths() + [sysconfig.get_paths()['include']]))")
FLAGS="$INCLUDES -I$CU/include -I$KIT/torch_cuda -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H -O0"
status=0
for file in "$@"; do
  case $file in
    *.cu) "$CU/bin/nvcc" -c -o /dev/null $FLAGS -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a "$file" ;;
    *) g++ -c -o /dev/null -fPIC -w -std=c++20 $FLAGS "$file" ;;
  esac && echo "$file: compiles" || { echo "$file: FAILED"; status=1; }
done
exit $status

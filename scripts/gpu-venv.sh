#!/usr/bin/env bash
# A virtualenv that serves with forge on a GPU image whose Python already holds torch and transformers
# but numpy 2 (the bundled tritonserver's python stub needs numpy < 2):
#   - the image's site-packages stay visible behind the venv (a .pth line), so its torch is used as is;
#     its scipy and scikit-learn, built for numpy 2, are hidden (transformers then does without them);
#   - numpy < 2, nvidia-pytriton and tritonclient go in front, from WHEEL_DIR (an offline machine) or the index;
#   - forge itself is installed editable, without dependencies.
#
#   scripts/gpu-venv.sh VENV [WHEEL_DIR | BUNDLE.tar.xz]     # BUNDLE: from scripts/gpu-bundle.sh
#   VENV/bin/python benchmarks/serve_gpu.py --tokenizer DIR
set -euo pipefail
venv=${1:?usage: scripts/gpu-venv.sh VENV [WHEEL_DIR]}
wheels=${2:-}
here=$(cd "$(dirname "$0")/.." && pwd)
base=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
python3 -m venv "$venv"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$base" > "$site/zz-base-image.pth"  # after the venv's own packages: its numpy wins
# a None entry in sys.modules reads as "not installed" to importlib.util.find_spec and to import
echo 'import sys; [sys.modules.setdefault(name, None) for name in ("scipy", "sklearn")]' > "$site/zz-hide-numpy2-only.pth"
if [ -f "$wheels" ]; then  # unpacked wheels: straight into site-packages
    tar -xJf "$wheels" -C "$site"
elif [ -n "$wheels" ]; then
    "$venv/bin/python" -m pip install -q --no-index --no-deps --no-compile "$wheels"/*.whl
else
    "$venv/bin/python" -m pip install -q "numpy<2" nvidia-pytriton "tritonclient[grpc]"
fi
"$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$here"
"$venv/bin/python" -c 'import numpy, torch, forge; print(f"gpu venv: numpy {numpy.__version__}, torch {torch.__version__}, cuda {torch.cuda.is_available()}")'

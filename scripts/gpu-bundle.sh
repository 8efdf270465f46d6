#!/usr/bin/env bash
# The packages a GPU image without a package index lacks for scripts/gpu-venv.sh, as one .tar.xz of unpacked
# wheels for Python 3.12 (about 44 MB: a carried working tree may hold 64 MiB): numpy < 2, nvidia-pytriton (its
# tritonserver; the python stubs and libpython of other Python versions left out), tritonclient and forge's
# small dependencies, at the versions of this checkout's environment where it has them.
#
#   scripts/gpu-bundle.sh OUT.tar.xz [PYTHON]      # PYTHON: the environment whose versions to pin (default python3)
set -euo pipefail
out=${1:?usage: scripts/gpu-bundle.sh OUT.tar.xz [PYTHON]}
python=${2:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pins=$("$python" - <<'PY'
import importlib.metadata as m
wanted = ["numpy", "nvidia-pytriton", "tritonclient", "grpcio", "python-rapidjson", "protobuf", "pluggy", "rich",
          "markdown-it-py", "mdurl", "platformdirs"]
for name in wanted:
    try:
        print(f"{name}=={m.version(name)}")
    except m.PackageNotFoundError:
        print(name if name != "numpy" else "numpy<2")
PY
)
python3 -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 -d "$work/wheels" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_35_x86_64 $pins
mkdir "$work/site"
for wheel in "$work"/wheels/*.whl; do
    python3 -m zipfile -e "$wheel" "$work/site"
done
rm -rf "$work"/site/pytriton/tritonserver/python_backend_stubs/{3.8,3.9,3.10,3.11,3.13} "$work"/site/nvidia_pytriton.libs/libpython3-*
chmod -R u+rwX,go+rX "$work/site"
find "$work/site" -path '*/bin/*' -o -name '*.so*' -o -name 'triton_python_backend_stub' | xargs chmod +x
tar -cJf "$out" -C "$work/site" .
echo "gpu bundle: $out ($(du -h "$out" | cut -f1))"

#!/usr/bin/env bash
# Build llama.cpp once, from the source vendored in the llama-cpp-python sdist, for the
# llama.cpp baselines of `pagedlm bench`:
#   * `llama-server` (driven by `pagedlm bench serving`, see benchmarks/llama_server_bench.sh);
#   * the shared libraries (libllama, libggml*, libmtmd) that llama-cpp-python loads, so that
#     `pagedlm bench throughput --baselines llama-cpp-python` runs the very same build.
# The Python package is then installed with its own CMake build switched off
# (-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF) and the prebuilt libraries copied into its lib/ folder,
# so llama.cpp is compiled exactly once. CPU only, -march=native (AVX2 on the bench machine).
#
# Nothing lands in the repository: source and binaries live under the prefix
# (default ~/.cache/pagedlm/llama.cpp/<version>). Every build step runs under `nice -n 19`
# with -j2 (JOBS=N overrides) because the machine is shared.
#
# usage: benchmarks/build_llama_cpp.sh [--prefix DIR] [--version X.Y.Z] [--no-python]
# afterwards: $PREFIX/bin/llama-server, $PREFIX/build-info.json
set -euo pipefail

VERSION=0.3.36  # keep in step with the `llamacpp` extra in pyproject.toml
PREFIX=""
INSTALL_PYTHON=1
JOBS="${JOBS:-2}"
# Extra compiler flags, e.g. CXXFLAGS_EXTRA="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" on a VM
# that advertises AMX but does not let processes use it (llama-server then dies of SIGILL
# when its thread pool starts).
CFLAGS_EXTRA="${CFLAGS_EXTRA:-${CXXFLAGS_EXTRA:-}}"
PYTHON="${PYTHON:-python}"

while [[ $# -gt 0 ]]; do
    case "$1" in
        --prefix) PREFIX="$2"; shift 2 ;;
        --version) VERSION="$2"; shift 2 ;;
        --no-python) INSTALL_PYTHON=0; shift ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done
PREFIX="${PREFIX:-$HOME/.cache/pagedlm/llama.cpp/$VERSION}"
NICE=(nice -n 19)

mkdir -p "$PREFIX"
PREFIX="$(cd "$PREFIX" && pwd)"
SRC="$PREFIX/src/llama_cpp_python-$VERSION"
BUILD="$PREFIX/build"

echo "== llama-cpp-python $VERSION -> $PREFIX"
if [[ ! -d "$SRC" ]]; then
    mkdir -p "$PREFIX/src"
    "$PYTHON" -m pip download --no-binary :all: --no-deps --no-cache-dir \
        "llama-cpp-python==$VERSION" -d "$PREFIX/src"
    tar -xzf "$PREFIX/src/llama_cpp_python-$VERSION.tar.gz" -C "$PREFIX/src"
fi

# Standalone llama.cpp build of just what we need. Shared libraries with an $ORIGIN rpath so
# llama-server and the copies inside the Python package find their siblings. No web UI (it
# would be downloaded), no TLS, no tests/examples.
echo "== configure"
"${NICE[@]}" cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON \
    -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON \
    -DCMAKE_INSTALL_RPATH='$ORIGIN' \
    -DGGML_NATIVE=ON \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF \
    -DLLAMA_BUILD_COMMON=ON \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DCMAKE_C_FLAGS="$CFLAGS_EXTRA" -DCMAKE_CXX_FLAGS="$CFLAGS_EXTRA"

echo "== build (-j$JOBS)"
# llama-server depends on llama, ggml*, and mtmd: every library llama-cpp-python loads.
"${NICE[@]}" cmake --build "$BUILD" --target llama-server mtmd -j "$JOBS"

mkdir -p "$PREFIX/bin"
ln -sf "$BUILD/bin/llama-server" "$PREFIX/bin/llama-server"
COMMIT="$(git -C "$SRC/vendor/llama.cpp" rev-parse --short HEAD 2>/dev/null || echo unknown)"
cat > "$PREFIX/build-info.json" <<EOF
{"llama_cpp_python": "$VERSION", "llama_cpp_commit": "$COMMIT", "ggml_native": true,
 "extra_flags": "$CFLAGS_EXTRA",
 "build_dir": "$BUILD", "llama_server": "$BUILD/bin/llama-server"}
EOF
"$BUILD/bin/llama-server" --version 2>&1 | head -n 3 || true

if [[ "$INSTALL_PYTHON" == 1 ]]; then
    echo "== install llama-cpp-python (no CMake build of its own)"
    # Drop any llama.cpp build a previous install put inside the package.
    "$PYTHON" -m pip uninstall -y llama-cpp-python >/dev/null 2>&1 || true
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "${NICE[@]}" \
        "$PYTHON" -m pip install --no-cache-dir "$SRC"
    PKG_DIR="$("$PYTHON" - <<'EOF'
import importlib.util, pathlib
spec = importlib.util.find_spec("llama_cpp")
print(pathlib.Path(spec.origin).parent)
EOF
)"
    mkdir -p "$PKG_DIR/lib"
    # The package loads lib/libllama.so (and lib/libmtmd.so for multimodal chat formats).
    cp -fP "$BUILD"/bin/lib*.so* "$PKG_DIR/lib/"  # -P: keep the soname symlinks as links
    "$PYTHON" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, 'loads', llama_cpp.llama_cpp._base_path)"
fi
echo "== done: $PREFIX/bin/llama-server"

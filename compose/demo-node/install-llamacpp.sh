#!/bin/sh
# llama.cpp on the demo node's PATH (ggml-rpc-server and llama-server in /usr/local/bin), so the trial needs
# no build step before its first chat: the console's probe finds them there and registers them as the
# node's install. The node keeps cmake, ninja and g++, so the Builds page's own build still works.
#
# From the pinned source, the same file the console uploads to nodes (llamacpp/source.py's PINNED;
# tests/compose/test_demo_node_pins.py checks that the pins below agree): fetched from the package index
# pip uses, its SHA-256 checked before it is unpacked, built with the console's own CPU flags
# (builds/job.py cmake_flags("cpu")), statically linked so nothing else of the build stays in the image.
# A prebuilt/ folder in the build context that holds llama-server is used instead (the compose test's).
set -eu
prebuilt=/tmp/demo-node/prebuilt
if [ -x "$prebuilt/llama-server" ]; then
  echo "demo node: llama.cpp from the build context's prebuilt/ folder"
  install -m 0755 "$prebuilt/llama-server" "$prebuilt/ggml-rpc-server" /usr/local/bin/
  for lib in "$prebuilt"/*.so*; do [ -e "$lib" ] && cp -P "$lib" /usr/local/lib/; done
  ldconfig
  exit 0
fi

index=${PIP_INDEX_URL:-https://pypi.org/simple}
file="$(echo "$LLAMACPP_PACKAGE" | tr - _)-$LLAMACPP_VERSION.tar.gz"
work=$(mktemp -d)
echo "demo node: fetching $file from $index"
page=$(curl -fsSL -H 'Accept: text/html' "${index%/}/$LLAMACPP_PACKAGE/") \
  || { echo "demo node: could not read ${index%/}/$LLAMACPP_PACKAGE/ (no network, or a proxy's certificate?)" >&2; exit 1; }
url=$(printf '%s\n' "$page" | grep -o "href=\"[^\"]*/$file[#\"][^\"]*" | head -n 1 | sed -e 's/^href="//' -e 's/#.*//')
[ -n "$url" ] || { echo "demo node: $file is not on $index" >&2; exit 1; }
case "$url" in http*) ;; *) url="${index%/}/$LLAMACPP_PACKAGE/$url" ;; esac
curl -fsSL -o "$work/$file" "$url"
echo "$LLAMACPP_SHA256  $work/$file" | sha256sum -c -
mkdir "$work/src"
tar -xzf "$work/$file" -C "$work/src" --strip-components=1
tree="$work/src/llama.cpp"
[ -f "$tree/CMakeLists.txt" ] || tree="$work/src"
# RAMDeck's one change to the source, as the console's build job makes it (builds/rpc_threshold.py, whose
# SED_EXPR this is; tests/compose/test_demo_node_pins.py keeps them equal): weight tensors above 256 KiB,
# not 10 MiB, take rpc-server's cache, so a warm load sends almost nothing.
rpc="$tree/ggml/src/ggml-rpc/ggml-rpc.cpp"
sed 's/^const size_t HASH_THRESHOLD = 10 \* 1024 \* 1024;/const size_t HASH_THRESHOLD = 256 * 1024;/' "$rpc" > "$rpc.ramdeck"
cat "$rpc.ramdeck" > "$rpc" && rm -f "$rpc.ramdeck"
# A CPU that lists AMX but faults on its instructions (a VM whose hypervisor does not pass them through) gets
# a build without AMX, or llama-server dies at its first answer: the console's build job does the same
# (builds/amx.py, whose program amx-check.c is; 2 means Linux refused AMX and llama.cpp leaves it off itself).
no_amx=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null && cc -O1 -mamx-tile /tmp/demo-node/amx-check.c -o "$work/amx-check" 2>/dev/null; then
  if sh -c '"$1" >/dev/null 2>&1' sh "$work/amx-check" 2>/dev/null; then status=0; else status=$?; fi
  if [ "$status" -ne 0 ] && [ "$status" -ne 2 ]; then
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    echo "demo node: this CPU lists AMX but faults on it: building without AMX ($no_amx)"
  fi
fi
cmake -S "$tree" -B "$work/build" -G Ninja -DBUILD_SHARED_LIBS=OFF \
  -DGGML_RPC=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx"
cmake --build "$work/build" -j "$(nproc)" --target ggml-rpc-server llama-server
install -m 0755 "$work/build/bin/llama-server" "$work/build/bin/ggml-rpc-server" /usr/local/bin/
rm -rf "$work"
echo "demo node: llama.cpp built from $file"

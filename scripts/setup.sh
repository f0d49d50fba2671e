#!/usr/bin/env bash
# Installs what rewindfs needs on a fresh Debian machine and is safe to run twice:
# Debian packages (FUSE 3 and its headers, pkg-config, git, ...), a .venv beside this
# script's repository, and the package with its test extras. Prints what it does.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

apt_pkgs=(fuse3 libfuse3-dev pkg-config gcc python3-dev patch git zstd ripgrep bubblewrap
          fuse-overlayfs sqlite3 postgresql slirp4netns libseccomp2 util-linux faketime)
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo_cmd=""
  if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null; then
      echo "setup: these Debian packages are missing: ${missing[*]}; there is no sudo here:" \
           "install them as root (apt-get install ${missing[*]}), then run this again" >&2
      exit 1
    fi
    sudo_cmd="sudo"
  fi
  echo "setup: installing Debian packages: ${missing[*]}"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi

py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$py" -m venv .venv
fi
stamp=.venv/.rewindfs-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing rewindfs and its test extras into .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test]"
  touch "$stamp"
fi

# pyfuse3 with scripts/pyfuse3/kernel-cache.patch (what it adds and why: README.md there):
# the pinned sdist from PyPI, patched, compiled against libfuse3-dev (pip fetches Cython
# from PyPI to regenerate the C). Rebuilt when the patch changes.
# REWINDFS_STOCK_PYFUSE3=1 keeps whatever pyfuse3 the venv has.
pyfuse3_version=3.5.0
patch_file=scripts/pyfuse3/kernel-cache.patch
want="pyfuse3 $pyfuse3_version $(sha256sum "$patch_file" | cut -d' ' -f1)"
pstamp=.venv/.pyfuse3-patched
if [ "${REWINDFS_STOCK_PYFUSE3:-0}" != 1 ] && [ "$(cat "$pstamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: building pyfuse3 $pyfuse3_version with $patch_file (half a minute on 2 cores)"
  build=$(mktemp -d)
  trap 'rm -rf "$build"' EXIT
  .venv/bin/python -m pip download -q --no-deps --no-binary pyfuse3 \
    "pyfuse3==$pyfuse3_version" -d "$build"
  tar -xzf "$build/pyfuse3-$pyfuse3_version.tar.gz" -C "$build"
  patch -s -p1 -d "$build/pyfuse3-$pyfuse3_version" < "$patch_file"
  .venv/bin/python -m pip install -q --no-deps --force-reinstall --no-cache-dir \
    "$build/pyfuse3-$pyfuse3_version"
  .venv/bin/python -c "import pyfuse3; assert 'inode_in_requests' in pyfuse3.extensions"
  echo "$want" > "$pstamp"
fi

# The stock binding, for the test subset that proves rewindfs still works on it
# (scripts/test.sh puts it first on PYTHONPATH); not used otherwise.
stock=.venv/pyfuse3-stock
if [ ! -f "$stock/.installed-$pyfuse3_version" ]; then
  echo "setup: installing stock pyfuse3 $pyfuse3_version into $stock (for the tests)"
  rm -rf "$stock"
  .venv/bin/python -m pip install -q --no-deps --target "$stock" "pyfuse3==$pyfuse3_version"
  touch "$stock/.installed-$pyfuse3_version"
fi

#!/usr/bin/env bash
# Set up ./.peers (idempotent): the peers' trainers that launch.bench.peers runs, unmodified, beside ours:
# SpecForge 0.2.0 and speculators 0.9.0 (with hs-connectors 0.9.0), and the packages they need to import and train
# offline that the interpreter lacks. Never into .venv: specforge pins torch 2.11, transformers 5.8.1 and sglang,
# none of which offline training needs, so every wheel goes in with --no-deps and the interpreter's own torch and
# transformers are the ones the peers use. The folder goes first on PYTHONPATH only in the peers' processes, so a
# package the interpreter already has in a version that fits is not put there (it would shadow its own):
#   PYTHONPATH=.peers .venv/bin/python -m speculators train ...
#   PYTHONPATH=.peers .venv/bin/python .peers/bin/specforge train ...
#
#   launch/setup_peers.sh                    install from the package index
#   PEERS_WHEELS=DIR launch/setup_peers.sh   install from the wheels in DIR only (the GPU machine has no index)
#   launch/setup_peers.sh --download DIR [NAME==VERSION ...]
#                                            download into DIR the wheels for Python 3.12 on x86-64 Linux that the
#                                            GPU image lacks (and the extra ones named), for PEERS_WHEELS there
# The interpreter: $DFLASH_PYTHON, else .venv/bin/python, else python3 (as launch/run_all.sh chooses).
set -euo pipefail
cd "$(dirname "$0")/.."

# name | what the peers need | the version installed where that is missing. The GPU image has the last ones (IMAGE),
# so --download leaves them out unless named; datasets 5.1 needs its pyarrow to be >= 24.
REQUIREMENTS="
specforge|==0.2.0|0.2.0
speculators|==0.9.0|0.9.0
hs-connectors|==0.9.0|0.9.0
pydantic|>=2.7|2.14.4
pydantic-core||2.50.5
annotated-types|>=0.6|0.8.0
typing-inspection|>=0.4.0|0.4.5
typing-extensions|>=4.14|4.16.0
pydantic-settings|>=2.0|2.16.3
python-dotenv|>=1.2.2|1.2.4
datasets|>=4.0,<=5.1.0|5.1.0
dill|>=0.3.0,<0.4.2|0.4.1
multiprocess|<0.70.20|0.70.19
loguru|>=0.7.2,<=0.7.3|0.7.3
openai|>=2.0.0|3.63.0
jiter|>=0.16,<1|0.19.0
anyio|>=4.10|4.16.0
sniffio||1.3.1
distro||1.9.0
httpx2|>=2.12,<3|2.17.0
httpcore2|==2.17.0|2.17.0
truststore|>=0.10|0.10.5
h11|>=0.16|0.16.0
xxhash||4.1.0
pyarrow|>=24.0.0|26.0.1
pandas||3.1.1
python-dateutil|>=2.9.0|2.9.0.post0
six||1.17.0
aiohttp||3.14.5
aiohappyeyeballs|>=2.5.0|2.7.1
aiosignal|>=1.4.0|1.4.0
attrs|>=17.3.0|26.1.0
frozenlist|>=1.1.1|1.8.0
multidict|>=4.5,<8.0|7.2.1
propcache|>=0.2.0|0.5.4
yarl|>=1.25.1,<2.0|1.25.1
"
IMAGE="pyarrow pandas python-dateutil six h11 xxhash aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl"

pins() {  # every name==version of REQUIREMENTS, less those the GPU image has
  echo "$REQUIREMENTS" | awk -F'|' -v image=" $IMAGE " 'NF == 3 && index(image, " " $1 " ") == 0 {print $1 "==" $3}'
}

if [ "${1:-}" = "--download" ]; then
  DIR=${2:?usage: launch/setup_peers.sh --download DIR [NAME==VERSION ...]}
  shift 2
  mkdir -p "$DIR"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$DIR" $(pins) "$@" 2>&1 | grep -v 'is ignored' || true
  ls "$DIR"
  du -sh "$DIR"
  exit 0
fi

if [ -n "${DFLASH_PYTHON:-}" ]; then
  PY="$DFLASH_PYTHON"
elif [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
else
  PY=python3
fi
"$PY" -c "import torch, transformers" 2>/dev/null || {
  echo "the interpreter $PY lacks torch or transformers: run launch/setup.sh first" >&2
  exit 2
}

# What .peers must hold: each requirement the interpreter (without .peers) does not meet, at its pinned version,
# unless .peers already holds that version.
TODO=$(REQUIREMENTS="$REQUIREMENTS" "$PY" - <<'EOF'
import os
from importlib import metadata
from pathlib import Path

from packaging.specifiers import SpecifierSet

rows = [line.split("|") for line in os.environ["REQUIREMENTS"].split() if line]
todo = []
for name, spec, pin in rows:
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        have = None
    # pydantic-core must be the one its pydantic was built with: it comes along whenever pydantic does.
    follows_pydantic = name == "pydantic-core" and "pydantic" in todo
    if have is None or not SpecifierSet(spec).contains(have, prereleases=True) or follows_pydantic:
        todo.append(name)
        stem = f"{name.replace('-', '_')}-{pin}.dist-info"
        if not any(p.name.lower() == stem.lower() for p in Path(".peers").glob("*.dist-info")):
            print(f"{name}=={pin}")
EOF
)
if [ -n "$TODO" ]; then
  if [ -n "${PEERS_WHEELS:-}" ]; then
    SOURCE=(--no-index --find-links "$PEERS_WHEELS")
  else
    SOURCE=()
  fi
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-deps --no-compile --upgrade --target .peers "${SOURCE[@]}" $TODO 2>&1 |
    { grep -v 'is ignored' || true; }
  echo "installed into .peers:" $TODO
else
  echo "nothing to install: .peers is complete"
fi

# The check itself: both peers' command lines import with the interpreter's torch and transformers.
export PYTHONPATH=".peers${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -m speculators train --help >/dev/null
"$PY" .peers/bin/specforge --help >/dev/null
"$PY" - <<'EOF'
from importlib import metadata

import torch
import transformers

peers = ", ".join(f"{name} {metadata.version(name)}" for name in ("specforge", "speculators", "hs-connectors"))
print(f"{peers}; torch {torch.__version__}, transformers {transformers.__version__}")
EOF

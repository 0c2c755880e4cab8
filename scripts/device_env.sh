# Sourced by the scripts/device_*.sh measurement scripts, from the repository root: unbuffered Python, the
# wheels a GPU host lacks (.whl/*.whl, or WHL_DIR; carried with the call) installed into /tmp/site unless
# SKIP_WHEELS is set, and this checkout first on PYTHONPATH.
export PYTHONUNBUFFERED=1
WHL=${WHL_DIR:-.whl}
if [[ -z ${SKIP_WHEELS:-} ]] && ls "$WHL"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHL"/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

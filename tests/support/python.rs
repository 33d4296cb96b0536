//! The tests' Python (a venv with tests/requirements.txt), for the cross-checks that run a
//! Python tool: Polars, schemathesis.

use std::process::Command;

/// How to get the tests' Python venv, for a failure message.
pub const VENV_SETUP: &str = "run `bash .ci/run`, or create the environment by hand:\n  \
     python3 -m venv /var/tmp/gpuwarden-venv && \
     /var/tmp/gpuwarden-venv/bin/pip install -r tests/requirements.txt\n  \
     export GPUWARDEN_PYTHON=/var/tmp/gpuwarden-venv/bin/python";

/// The tests' Python (tests/requirements.txt installed): GPUWARDEN_PYTHON, set by .ci/run, after
/// checking that `check` runs in it. Missing, it fails the test that needs it for `purpose`: a
/// cross-check that silently skips checks nothing.
pub fn venv_python(purpose: &str, check: &str) -> String {
    let python = std::env::var("GPUWARDEN_PYTHON")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| {
            panic!("GPUWARDEN_PYTHON is not set; this test needs {purpose}: {VENV_SETUP}")
        });
    let out = Command::new(&python)
        .args(["-c", check])
        .output()
        .unwrap_or_else(|e| panic!("GPUWARDEN_PYTHON={python} does not run ({e}): {VENV_SETUP}"));
    assert!(
        out.status.success(),
        "GPUWARDEN_PYTHON={python} lacks {purpose}: {}\n{VENV_SETUP}",
        String::from_utf8_lossy(&out.stderr)
    );
    python
}

//! Builds a C++ program for a test: the CUDA kernels' CPU emulations. Shared by the tests of
//! several crates (included by path).

use std::path::PathBuf;
use std::process::Command;

/// The C++ compiler to use first, as make and cc-rs read it.
const CXX: psnet_config::env::EnvVar = psnet_config::env::EnvVar {
    name: "CXX",
    default: "c++",
    description: "tests: the C++ compiler that builds the kernels' CPU emulation",
};

/// Compiles `source` into an executable named `name` under cargo's scratch folder for
/// integration tests, with IEEE floating point as NVRTC compiles the kernels (no contraction,
/// no fast math). `Err` says why it could not (no C++ compiler); a compiler that ran and
/// refused the source panics, since that is a finding, not a skip.
pub fn build(name: &str, source: &str) -> Result<PathBuf, String> {
    // Built under a name of this process's own, then renamed into place: runs at once do not
    // collide.
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let pid = std::process::id();
    let src = dir.join(format!("{name}-{pid}.cpp"));
    std::fs::write(&src, source).map_err(|e| format!("{}: {e}", src.display()))?;
    let built = dir.join(format!("{name}-{pid}"));
    let exe = dir.join(name);
    let compilers: Vec<String> = CXX
        .get()
        .into_iter()
        .chain(["c++", "clang++", "g++"].map(String::from))
        .collect();
    let mut tried = Vec::new();
    for cxx in &compilers {
        let out = Command::new(cxx)
            .args(["-std=c++17", "-O1", "-ffp-contract=off", "-fno-fast-math"])
            .args([
                "-fno-strict-aliasing",
                "-fno-exceptions",
                "-fno-rtti",
                "-pthread",
            ])
            .arg("-o")
            .arg(&built)
            .arg(&src)
            .output();
        match out {
            Ok(o) if o.status.success() => {
                let _ = std::fs::remove_file(&src);
                std::fs::rename(&built, &exe).map_err(|e| format!("{}: {e}", exe.display()))?;
                return Ok(exe);
            }
            Ok(o) => panic!(
                "{cxx} could not compile {name}:\n{}",
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => tried.push(format!("{cxx}: {e}")),
        }
    }
    let _ = std::fs::remove_file(&src);
    Err(format!("no C++ compiler ({})", tried.join("; ")))
}

//! Records the git commit the library is built from (`OXMOE_GIT_COMMIT`), which
//! `oxmoe_build_id` reports, so benchmark results and bug reports can name the
//! exact build and the Python package can refuse a stale library.

use std::process::Command;

fn main() {
    let commit = Command::new("git")
        .args(["describe", "--always", "--abbrev=12", "--exclude=*"])
        .output()
        .ok()
        .filter(|out| out.status.success())
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=OXMOE_GIT_COMMIT={commit}");
    // Rerun when HEAD moves to another branch or commit.
    for path in [".git/HEAD", ".git/refs/heads", ".git/packed-refs"] {
        if std::path::Path::new(path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}

//! Records the git commit the library is built from (`OXMOE_GIT_COMMIT`), which
//! `oxmoe_build_id` reports, so benchmark results and bug reports can name the
//! exact build and the Python package can refuse a stale library. A build whose
//! sources differ from that commit's is marked `-dirty`.

use std::process::Command;

/// What the library is built from: a change to any of them is a different build.
const SOURCES: [&str; 6] = ["src", "kernels", "ffi", "build.rs", "Cargo.toml", "Cargo.lock"];

fn git(args: &[&str]) -> Option<std::process::Output> {
    Command::new("git").args(args).output().ok()
}

fn main() {
    let commit = git(&["describe", "--always", "--abbrev=12", "--exclude=*"])
        .filter(|out| out.status.success())
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .map(|s| s.trim().to_owned());
    let commit = match commit {
        Some(commit) => {
            // `git diff --quiet` exits 1 when the sources differ from the commit's.
            let differs = git(&[&["diff", "--quiet", "HEAD", "--"][..], &SOURCES[..]].concat())
                .is_some_and(|out| out.status.code() == Some(1));
            if differs { format!("{commit}-dirty") } else { commit }
        }
        None => "unknown".to_owned(),
    };
    println!("cargo:rustc-env=OXMOE_GIT_COMMIT={commit}");
    // Rerun when HEAD moves to another branch or commit, or a source changes.
    for path in [".git/HEAD", ".git/refs/heads", ".git/packed-refs"].into_iter().chain(SOURCES) {
        if std::path::Path::new(path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
}

//! Generates the raw bindings to the vendored XLA FFI C header with bindgen.
//!
//! bindgen needs libclang: Debian's `libclang-dev`, or the `libclang` wheel from
//! PyPI with `LIBCLANG_PATH` pointing at its `clang/native` folder (what
//! `scripts/setup` arranges).

use std::{env, path::PathBuf};

fn main() {
    let header = "include/xla/ffi/api/c_api.h";
    println!("cargo:rerun-if-changed={header}");
    println!("cargo:rerun-if-env-changed=LIBCLANG_PATH");
    let bindings = bindgen::Builder::default()
        .header(header)
        .allowlist_item("XLA_FFI_.*")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(true)
        .generate()
        .expect("bindgen could not translate the XLA FFI header (is libclang installed? see ffi/build.rs)");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("bindings.rs");
    bindings.write_to_file(out).expect("writing the XLA FFI bindings");
}

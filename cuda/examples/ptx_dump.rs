//! Write the PTX of every kernel source, as the engine would compile it now (NVRTC,
//! `SPECLAB_KERNEL_DEFINES` applied), to a directory: `<dir>/<source>.ptx`. No GPU needed,
//! only libnvrtc (cuda/README.md). For local resource reports and SASS before a device
//! call, e.g. with ptxas and nvdisasm from NVIDIA's PyPI wheels:
//!
//!   SPECLAB_KERNEL_DEFINES=W4_XS=1 cargo run --release -p speclab-cuda --example ptx_dump -- /tmp/ptx
//!   ptxas -arch=sm_90a -v /tmp/ptx/linear.cu.ptx -o /tmp/linear.cubin
//!
//! Usage: `ptx_dump DIR [ARCH]` (ARCH default sm_90a). Exit 1 on any compile error.

use std::path::PathBuf;

use speclab_cuda::kernels;

fn main() -> std::process::ExitCode {
    let mut args = std::env::args().skip(1);
    let Some(dir) = args.next().map(PathBuf::from) else {
        eprintln!("usage: ptx_dump DIR [ARCH]");
        return std::process::ExitCode::from(2);
    };
    let arch = args
        .next()
        .unwrap_or_else(|| kernels::DEFAULT_ARCH.to_string());
    let cache = dir.join("cache");
    let mut failed = false;
    for src in kernels::SOURCES {
        let out = dir.join(format!("{}.ptx", src.name));
        let written = kernels::compile(src, &arch, &cache)
            .map_err(|e| e.to_string())
            .and_then(|p| std::fs::write(&out, p.ptx).map_err(|e| e.to_string()));
        match written {
            Ok(()) => println!("{}", out.display()),
            Err(e) => {
                eprintln!("{}: {e}", src.name);
                failed = true;
            }
        }
    }
    if failed {
        std::process::ExitCode::from(1)
    } else {
        std::process::ExitCode::SUCCESS
    }
}

//! Writing to stdout without panicking on a closed pipe.
//!
//! `println!` panics when stdout is a pipe whose reader has gone (`speclab run | head -1`).
//! `outln!` writes through [`write_line`], which exits quietly with status 0 on a
//! broken pipe (the reader asked for no more) and with status 1 and a message on any
//! other write error. Invariant: no stdout write of the CLI panics.

use std::io::Write;

/// `println!` that exits quietly when stdout is closed (see the module doc).
macro_rules! outln {
    () => {
        $crate::cli::out::write_line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::cli::out::write_line(format_args!($($arg)*))
    };
}

/// Write one line to stdout; exit on a broken pipe (0) or another write error (1).
pub fn write_line(args: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|()| out.write_all(b"\n")) {
        exit_on_write_error(&e);
    }
}

/// Exit after a failed stdout write: quietly for a closed pipe, with the error otherwise.
pub fn exit_on_write_error(e: &std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    eprintln!("error: writing to stdout: {e}");
    std::process::exit(1);
}

/// The panic hook's backstop for writes that still go through `print!`: a panic whose
/// message is std's "failed printing to stdout: Broken pipe" exits quietly instead.
pub fn install_broken_pipe_hook() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.contains("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(0);
        }
        default(info);
    }));
}

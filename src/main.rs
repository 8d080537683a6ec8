fn main() -> std::process::ExitCode {
    archfs::cli::main()
}

fn main() -> std::process::ExitCode {
    archfs::commands::main()
}

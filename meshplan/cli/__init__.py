"""The command line (typer + rich): parse, build a request, call one library function, print."""

from megacp.serve.cli import entry

entry()

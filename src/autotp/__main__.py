from autotp.cli import entry

entry()

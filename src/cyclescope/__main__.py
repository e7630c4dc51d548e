from cyclescope.cli.main import entry

entry()

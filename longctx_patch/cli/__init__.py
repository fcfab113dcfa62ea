"""The `longctx` command line: a thin click front end over longctx_patch."""

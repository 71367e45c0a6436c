from prefixcache.cli import main

main()

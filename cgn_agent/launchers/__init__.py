"""Small launchers for engines that have no server command of their own."""

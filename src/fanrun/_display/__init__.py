"""How the ranks' output shows: the output mux, terminal and notebook views, the live panel."""
